"""The Ray actors: thin hosts around the same gRPC servers that run outside Ray.

A ModelServiceHost builds one model service (deploy.hosting, the composition the CLI and
the tests use too) on its node's address and a free port; an OrchestratorHost connects to
the two through their actor handles (so it finds a restarted service on its new port),
serves the client API and kills a service that hangs, for Ray to restart (deploy.liveness).
Neither adds behaviour of its own: what the services do, how they are secured
(specdec.serving.security: TLS, mTLS, a token, plaintext only where allowed) and observed
(specdec.serving.telemetry, from the OTEL_* variables of the actor's environment, e.g. a
runtime_env) is the same inside and outside Ray. A Ray worker runs no command line, so its actors'
entry (worker_environment) reads that environment, as cli.options.apply_environment does elsewhere:
the OTEL_* variables, SPECDEC_CACHE and, where a model is hosted, SPECDEC_FUSE.

Ray's decorators are applied where the actors are created (deploy.ray_deploy). Ray, and
deploy.hosting (torch and the models), are imported inside the actors: a driver that only
creates them needs neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec.serving.security import ClientSecurity, ServerSecurity

LOOPBACK = "127.0.0.1"


class _Host:
    host: str
    port: int
    node_id: str
    server: object
    telemetry: object

    def _locate(self, loopback: bool) -> None:
        """Where to bind: this node's address, or loopback when the whole cluster is this machine."""
        import ray

        self.host = LOOPBACK if loopback else ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()

    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def where(self) -> dict:
        return {"endpoint": self.endpoint(), "node_id": self.node_id, "pid": os.getpid()}

    def stop(self, grace: float = 5.0) -> None:
        """Finish the calls in flight (up to `grace` seconds), then flush telemetry."""
        self.server.stop(grace).wait()
        self.telemetry.shutdown()


class ModelServiceHost(_Host):
    """The draft or target service, in a Ray actor."""

    def __init__(self, config: ModelServiceConfig, security: ServerSecurity, loopback: bool):
        from deploy import hosting
        from specdec.serving import lifecycle, telemetry

        self._locate(loopback)
        self.telemetry = telemetry.setup(config.role, environ=worker_environment(hosts_model=True))
        self.server, self.port = hosting.start_model_service(config, self.host, 0, security, self.telemetry)
        lifecycle.freeze_heap()


class OrchestratorHost(_Host):
    """The orchestrator, in a Ray actor, reaching the services through their actor handles."""

    def __init__(
        self,
        draft,
        target,
        port: int,
        config: OrchestratorConfig,
        security: ServerSecurity,
        service_security: ClientSecurity,
        loopback: bool,
        health_timeout: float = 0.0,
    ):
        from deploy import hosting, liveness
        from specdec.serving import lifecycle, telemetry

        self._locate(loopback)
        self.telemetry = telemetry.setup("orchestrator", environ=worker_environment())
        self.orchestrator = hosting.start_orchestrator(
            actor_endpoint(draft),
            actor_endpoint(target),
            config,
            self.host,
            port,
            security,
            service_security,
            self.telemetry,
        )
        self.server, self.port, self.pair = self.orchestrator.server, self.orchestrator.port, self.orchestrator.pair
        # A service that hangs is killed, for Ray to restart (deploy.liveness); health_timeout 0: never.
        stubs = {"draft": self.pair.draft, "target": self.pair.target}
        self.watch = liveness.ServiceWatch(stubs, {"draft": draft, "target": target}, health_timeout).start()
        lifecycle.freeze_heap()

    def where(self) -> dict:
        http = self.orchestrator.http
        return {**super().where(), "http_url": http.url if http else None}

    def stop(self, grace: float = 5.0) -> None:
        self.watch.stop()
        if self.orchestrator.http is not None:
            self.orchestrator.http.stop()
        super().stop(grace)

    def reopens(self) -> dict[str, int]:
        """Sessions re-opened after each service lost them, since this actor started."""
        return {"draft": self.pair.draft.reopens, "target": self.pair.target.reopens}


def worker_environment(hosts_model: bool = False) -> dict[str, str]:
    """A Ray worker's settings from its own environment (a runtime_env's variables, else those of the
    raylet that started it), read at an actor's entry as it has no command line: the cache
    (specdec.weights.embedded.set_cache_dir) and, for an actor that hosts a model, the fusion setting
    (specdec.runtime.graphs.set_fuse, which imports torch) are set; the environment is returned for
    specdec.serving.telemetry.setup."""
    from specdec.weights import embedded

    environ = dict(os.environ)
    embedded.set_cache_dir(environ.get(embedded.CACHE_ENV))
    if hosts_model:
        from specdec.runtime import graphs

        graphs.set_fuse(environ.get(graphs.FUSE_ENV))
    return environ


def actor_endpoint(handle) -> Callable[[float], str]:
    """A resolver for orchestrator.recovery: the service actor's current HOST:PORT.

    While the actor restarts, the call waits for it (up to the timeout).
    """
    import ray

    def resolve(timeout: float) -> str:
        return ray.get(handle.endpoint.remote(), timeout=timeout)

    return resolve
