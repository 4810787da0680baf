"""The Ray actors: thin hosts around the same gRPC servers that run outside Ray.

A ModelServiceHost loads one model and serves it with draft_service.server.serve or
target_service.server.serve on its node's address and a free port; an OrchestratorHost
connects to the two through their actor handles (so it finds a restarted service on its new
port) and serves the client API with orchestrator.server.serve. Neither adds behaviour of
its own: what the services do is the same inside and outside Ray.

Ray's decorators are applied where the actors are created (deploy.ray_deploy), so this
module imports ray only inside the actors.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from orchestrator.recovery import RecoveryConfig
from specdec.models import ModelSpec


def _node() -> tuple[str, str]:
    """(this node's IP address, its Ray node id)."""
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


class _Host:
    host: str
    port: int
    node_id: str

    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def where(self) -> dict:
        return {"endpoint": self.endpoint(), "node_id": self.node_id, "pid": os.getpid()}


class ModelServiceHost(_Host):
    """The draft or target service, in a Ray actor."""

    def __init__(self, role: str, spec: ModelSpec):
        from specdec.backend import HFBackend

        if role == "draft":
            from draft_service.server import serve
        elif role == "target":
            from target_service.server import serve
        else:
            raise ValueError(f"role must be 'draft' or 'target', not {role!r}")
        self.host, self.node_id = _node()
        self.server, self.port = serve(HFBackend(spec), self.host, 0)


class OrchestratorHost(_Host):
    """The orchestrator, in a Ray actor, reaching the services through their actor handles."""

    def __init__(self, draft, target, port: int, recovery: RecoveryConfig):
        from orchestrator.server import connect, serve

        self.pair = connect(actor_endpoint(draft), actor_endpoint(target), recovery=recovery)
        self.host, self.node_id = _node()
        self.server, self.port = serve(self.pair, self.host, port)

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
