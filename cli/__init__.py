"""The `specdec` command line: the composition root, above everything it assembles.

Layers, bottom up: specdec (the runtime) -> draft_service, target_service, orchestrator ->
deploy -> bench -> cli. This package reads argv and the environment, and passes what it
reads down: the bearer tokens ($SPECDEC_AUTH_TOKEN, $SPECDEC_SERVICE_AUTH_TOKEN), OTEL_* (to
specdec.serving.telemetry.setup), SPECDEC_CACHE and SPECDEC_FUSE (options.apply_environment). Below it
only Ray reads RAY_*, and a Ray actor, which has no command line, its own environment
(deploy.ray_actors.worker_environment). One module a command group: generate (the client),
serving (the services and `serve`), bench (bench, loadtest), ray; options holds the flag groups
they share.
"""
