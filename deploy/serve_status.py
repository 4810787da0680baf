"""A specdec Serve application's replicas as the cluster has them: their names, their status and
the door's health report.

Both sides of a Serve deployment read them: the driver (deploy.ray_serve: `specdec ray status`,
which finds the application's replicas) and the door replica (deploy.serve_replicas: GET /health,
and the pair replicas, which name their services with service_name). Serve names a replica's
actor SERVE_REPLICA::APP#DEPLOYMENT#ID in its namespace; a pair replica's draft and target are
actors NAME-ID-draft and NAME-ID-target in deploy.ray_deploy's NAMESPACE.

This module expects a connected driver (or runs in a replica); it imports Ray only in its functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from deploy.ray_deploy import NAMESPACE, ActorStatus, describe
from specdec.serving import security
from specdec.serving.security import ClientSecurity

REPLICA_PREFIX = "SERVE_REPLICA::"  # Serve names a replica's actor SERVE_REPLICA::APP#DEPLOYMENT#ID
SERVE_NAMESPACE = "serve"


def service_name(name: str, replica: str, role: str) -> str:
    """The actor name of a replica's draft or target service (in NAMESPACE)."""
    return f"{name}-{replica}-{role}"


@dataclass(frozen=True)
class Replica:
    """A replica of the application: its actor (role "pair" or "door") and a pair's services."""

    id: str
    actor: ActorStatus
    services: tuple[ActorStatus, ...] = ()


def status(name: str, probe_seconds: float = 5.0) -> tuple[str, list[Replica]]:
    """The application's state as Serve reports it, and each live replica with its services."""
    import ray
    from ray import serve

    app = serve.status().applications.get(name) if running() else None
    if app is None:
        return "ABSENT", []
    node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    replicas = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        app_name, deployment, replica = _replica_of(actor)
        if app_name != name:
            continue
        handle = ray.get_actor(actor["name"], namespace=SERVE_NAMESPACE)
        role = {"Pair": "pair", "Door": "door"}.get(deployment, deployment)
        services = []
        if role == "pair":
            for service in ("draft", "target"):
                services.append(_service(name, replica, service, node_ips, probe_seconds))
        replicas.append(Replica(replica, describe(handle, role, node_ips, endpoint=False), tuple(services)))
    replicas.sort(key=lambda r: (r.actor.role != "door", r.id))
    return app.status.value, replicas


def health(name: str, service_security: ClientSecurity, timeout: float = 2.0) -> dict:
    """GET /health of the door: each pair replica, its actor's state and its services' gRPC
    health. "ok": every pair serves; "degraded": some do; "unavailable": none."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, replicas = status(name, probe_seconds=timeout)
    report = []
    for r in replicas:
        if r.actor.role != "pair":
            continue
        services = {}
        for s in r.services:
            if not s.endpoint or s.endpoint == "?":
                services[s.role] = "NOT_ANSWERING" if s.answering is False else s.state
                continue
            link = security.channel(s.endpoint, service_security)
            try:
                reply = health_pb2_grpc.HealthStub(link).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
                services[s.role] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except Exception as err:  # noqa: BLE001 - grpc.RpcError: its code is the report
                services[s.role] = getattr(err, "code", lambda: "UNREACHABLE")().name
            finally:
                link.close()
        serving = r.actor.state == "ALIVE" and all(v == "SERVING" for v in services.values()) and len(services) == 2
        report.append(
            {
                "replica": r.id,
                "state": r.actor.state,
                "node_ip": r.actor.node_ip,
                "serving": serving,
                "services": services,
            }
        )
    ready = sum(r["serving"] for r in report)
    overall = "ok" if report and ready == len(report) else "degraded" if ready else "unavailable"
    return {"status": overall, "replicas": report}


def running() -> bool:
    """Whether Serve's controller runs on this cluster (serve.status() would start none)."""
    import ray

    return any(a["name"] == "SERVE_CONTROLLER_ACTOR" for a in ray.util.list_named_actors(all_namespaces=True))


def _replica_of(actor: dict) -> tuple[str, str, str]:
    """(application, deployment, replica id) of a Serve replica's named actor, else empties."""
    name = actor["name"]
    if actor.get("namespace") != SERVE_NAMESPACE or not name.startswith(REPLICA_PREFIX):
        return "", "", ""
    parts = name[len(REPLICA_PREFIX) :].split("#")
    return tuple(parts) if len(parts) == 3 else ("", "", "")


def _service(name: str, replica: str, role: str, node_ips: dict, probe_seconds: float) -> ActorStatus:
    import ray

    try:
        handle = ray.get_actor(service_name(name, replica, role), namespace=NAMESPACE)
    except ValueError:
        return ActorStatus(role, "ABSENT")
    return describe(handle, role, node_ips, probe_seconds=probe_seconds)
