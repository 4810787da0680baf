"""The orchestrator: the accept/resample loop across the two services, and the client API."""
