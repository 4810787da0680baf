"""specdec: distributed speculative decoding. This package is what the three services share.

Its packages, each importing only those below it (pyproject.toml's import-linter contracts):
- specdec.serving: the gRPC plumbing of a service (servicer helpers, the step stream, transport
  security, admission and drain, telemetry, probability rows on the wire).
- specdec.runtime: a model service's engine (backends, the slot KV cache, per-session engine and
  its worker thread, static graphs, the prefix cache, placement on cores, stand-in models).
- specdec.decoding: what a token is drawn from, as pure functions (the sampling rule, sampling
  transforms, penalties and biases, grammar masks).
- specdec.weights: where a model's weights come from (hub ids, local paths, the embedded default,
  the grown targets and rounded drafts built from it).
- specdec.limits, specdec.validation, specdec.errors: the caps, the stateless request checks and
  the errors with their status codes, which every layer uses.
- specdec.v1: the generated gRPC stubs (protos/).
The services themselves live in draft_service/, target_service/ and orchestrator/.
"""

__version__ = "0.1.0"
