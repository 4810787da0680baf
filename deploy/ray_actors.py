"""The Ray actors: thin hosts around the same gRPC servers that run outside Ray.

A ModelServiceHost loads one model (or drafter) and serves it with draft_service.server.serve
or target_service.server.serve on its node's address and a free port; an OrchestratorHost
connects to the two through their actor handles (so it finds a restarted service on its new
port) and serves the client API with orchestrator.server.serve. Neither adds behaviour of
its own: what the services do, how they are secured (specdec.security: TLS, mTLS, a token,
plaintext only where allowed) and observed (specdec.telemetry, from the OTEL_* variables of
the actor's environment, e.g. a runtime_env) is the same inside and outside Ray.

Ray's decorators are applied where the actors are created (deploy.ray_deploy), so this
module imports ray only inside the actors.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from orchestrator.recovery import RecoveryConfig
from specdec.models import ModelSpec
from specdec.security import ClientSecurity, ServerSecurity

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

    def __init__(self, role: str, spec: ModelSpec, drafter: str, security: ServerSecurity, loopback: bool):
        from specdec import telemetry

        if role not in ("draft", "target"):
            raise ValueError(f"role must be 'draft' or 'target', not {role!r}")
        self._locate(loopback)
        self.telemetry = telemetry.setup(role)
        if role == "draft":
            from draft_service import drafters
            from draft_service.server import serve

            backend, method = drafters.make(drafter, spec)
            self.server, self.port = serve(backend, self.host, 0, method, security, self.telemetry)
        else:
            from specdec.backend import HFBackend
            from target_service.server import serve

            self.server, self.port = serve(HFBackend(spec), self.host, 0, security, self.telemetry)


class OrchestratorHost(_Host):
    """The orchestrator, in a Ray actor, reaching the services through their actor handles."""

    def __init__(
        self,
        draft,
        target,
        port: int,
        recovery: RecoveryConfig,
        security: ServerSecurity,
        service_security: ClientSecurity,
        loopback: bool,
        http_port: int | None = None,
    ):
        from orchestrator.server import connect, serve
        from specdec import telemetry

        self._locate(loopback)
        self.telemetry = telemetry.setup("orchestrator")
        self.pair = connect(
            actor_endpoint(draft),
            actor_endpoint(target),
            security=service_security,
            telemetry=self.telemetry,
            recovery=recovery,
        )
        self.server, self.port = serve(self.pair, self.host, port, security, self.telemetry)
        self.http = None
        if http_port is not None:  # a client of the gRPC port above (its /health: the orchestrator's)
            from orchestrator.openai_api import serve_http

            own = ClientSecurity(root_ca=security.cert_chain, token=security.token)
            model = self.pair.model_name
            self.http = serve_http(self.endpoint(), self.host, http_port, own, security, self.telemetry, model)

    def where(self) -> dict:
        return {**super().where(), "http_url": self.http.url if self.http else None}

    def stop(self, grace: float = 5.0) -> None:
        if self.http is not None:
            self.http.stop()
        super().stop(grace)

    def reopens(self) -> dict[str, int]:
        """Sessions re-opened after each service lost them, since this actor started."""
        return {"draft": self.pair.draft.reopens, "target": self.pair.target.reopens}


def actor_endpoint(handle) -> Callable[[float], str]:
    """A resolver for orchestrator.recovery: the service actor's current HOST:PORT.

    While the actor restarts, the call waits for it (up to the timeout).
    """
    import ray

    def resolve(timeout: float) -> str:
        return ray.get(handle.endpoint.remote(), timeout=timeout)

    return resolve
