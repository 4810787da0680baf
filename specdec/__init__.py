"""specdec: distributed speculative decoding.

This package holds what the services share: generated stubs (specdec.v1), errors, model
loading, sampling transforms, per-session KV caches, the gRPC plumbing, and the CLI.
The services themselves live in draft_service/, target_service/ and orchestrator/.
"""

__version__ = "0.1.0"
