"""The `specdec` command line: the composition root, above everything it assembles.

Layers, bottom up: specdec (the runtime) -> draft_service, target_service, orchestrator ->
deploy -> bench -> cli. This package reads argv; the environment is read here for the
bearer tokens ($SPECDEC_AUTH_TOKEN, $SPECDEC_SERVICE_AUTH_TOKEN) and, below it, only where a
standard says so: OTEL_* by specdec.telemetry.setup, SPECDEC_CACHE by specdec.models, RAY_*
by Ray. One module a command group: generate (the client), serving (the services and
`serve`), bench (bench, loadtest), ray; options holds the flag groups they share.
"""
