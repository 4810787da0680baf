"""Ways to run the three services: local processes (deploy.local)."""
