"""specdec on a Ray cluster: bring a deployment up, take it down, report on it.

A deployment named N is three detached actors and one placement group, all named after N
in the driver's Ray namespace (the CLI uses `specdec`), so they outlive `specdec ray up`
and `down` and `status` find them again:
- `N-pg`: a placement group of two bundles, the draft's resources then the target's;
  `pack` places both on one node (STRICT_PACK, e.g. a GPU pair), `spread` on two different
  nodes (STRICT_SPREAD, e.g. two hosts);
- `N-draft`, `N-target`: the model services (deploy.ray_actors.ModelServiceHost), each in
  its bundle, restarted by Ray when they die (`max_restarts`), killed by the orchestrator's
  host when they hang (`health_timeout`, deploy.liveness); a restart binds a fresh
  port, which the orchestrator finds through the actor handle (orchestrator.recovery);
- `N-orchestrator`: the client API on its node's address (by default the head node's, so
  the address clients use stays put), restarted too, and killed by the target's host when it
  hangs; with a fixed port it comes back at the
  same address.

The actors bind their node's address, so their links cross the cluster's network: they need
TLS (`server_security` with a certificate; the orchestrator checks the services with
`service_security`) or plaintext explicitly allowed (`allow_insecure` on both), as anywhere
else (specdec.serving.security). A cluster that is this one machine may bind loopback instead. The model
services require the token the orchestrator sends them (`service_security.token`), not the
clients' (`server_security.token`): `specdec ray up` makes one for them, so a client's token opens
no session on a model service.
These settings, keys and token included, reach the actors as constructor arguments, which
Ray's GCS keeps: run Ray with its token authentication on.

This module expects a connected driver (`connect`); it reads no argv or environment.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deploy import liveness
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from deploy.ray_actors import ModelServiceHost, OrchestratorHost, actor_record
from specdec.serving.security import ClientSecurity, SecurityError, ServerSecurity

NAMESPACE = "specdec"
PLACEMENTS = {"pack": "STRICT_PACK", "spread": "STRICT_SPREAD"}
ROLES = ("orchestrator", "draft", "target")
# Every Ray head node has this resource; asking for a sliver of it pins an actor to the head.
HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class Resources:
    """What one model service reserves in its bundle."""

    cpus: float = 1.0
    gpus: float = 0.0

    def bundle(self) -> dict[str, float]:
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}


@dataclass(frozen=True)
class RayDeployConfig:
    name: str = "specdec"
    target: ModelServiceConfig = field(default_factory=lambda: ModelServiceConfig("target"))
    draft: ModelServiceConfig = field(default_factory=lambda: ModelServiceConfig("draft"))
    target_resources: Resources = Resources()
    draft_resources: Resources = Resources()
    placement: str = "pack"  # a key of PLACEMENTS
    orchestrator_cpus: float = 0.0
    orchestrator_on_head: bool = True
    port: int = 50051  # orchestrator port; 0 picks a free one (which moves if the actor restarts)
    max_restarts: int = -1  # per service actor; -1: no limit
    # seconds a service may answer nothing before the orchestrator kills its actor (Ray restarts it); 0: never
    health_timeout: float = liveness.UNRESPONSIVE_SECONDS
    placement_timeout: float = 120.0
    start_timeout: float = 600.0
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    server_security: ServerSecurity = field(default_factory=ServerSecurity)  # all three servers
    service_security: ClientSecurity = field(default_factory=ClientSecurity)  # orchestrator -> services
    loopback: bool = False  # bind 127.0.0.1, not the node's address: only when every node is this machine

    def __post_init__(self):
        if not (self.loopback or self.server_security.tls or self.server_security.allow_insecure):
            raise SecurityError(
                "the actors serve on their nodes' addresses: give --tls-cert and --tls-key, or "
                "--allow-insecure to serve plaintext gRPC on a trusted cluster network"
            )
        if not (self.loopback or self.service_security.uses_tls or self.service_security.allow_insecure):
            raise SecurityError(
                "the orchestrator reaches the services over the cluster's network: give --service-tls-ca "
                "(or --service-tls), or --allow-insecure on a trusted cluster network"
            )
        if (self.draft.role, self.target.role) != ("draft", "target"):
            raise ValueError("draft and target must be configs of the draft and target roles")
        if not self.name:
            raise ValueError("the deployment name must not be empty")
        if not self.health_timeout >= 0:  # nan too
            raise ValueError(f"--health-timeout must be >= 0 seconds, got {self.health_timeout}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {self.placement!r}")
        for role, res in (("draft", self.draft_resources), ("target", self.target_resources)):
            if not (_amount(res.cpus) and _amount(res.gpus) and res.bundle()):
                raise ValueError(
                    f"the {role} service needs some CPUs or GPUs (--{role}-cpus, --{role}-gpus: >= 0, one > 0), "
                    f"got {res.cpus:g} CPUs and {res.gpus:g} GPUs"
                )
        if not _amount(self.orchestrator_cpus):
            raise ValueError(f"--orchestrator-cpus must be >= 0, got {self.orchestrator_cpus:g}")
        if self.max_restarts < -1:
            raise ValueError(f"--max-restarts is a count >= 0, or -1 for no limit, got {self.max_restarts}")
        for flag, value in (("--timeout", self.start_timeout), ("the placement timeout", self.placement_timeout)):
            if not (_amount(value) and value > 0):
                raise ValueError(f"{flag} must be > 0 seconds, got {value:g}")


def _amount(value: float) -> bool:
    """A finite quantity >= 0 (NaN is not)."""
    return math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class Deployment:
    name: str
    address: str  # the orchestrator's HOST:PORT, for clients
    http_url: str | None = None  # its HTTP API, when config.orchestrator.http_port is set


def actor_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def pg_name(name: str) -> str:
    return f"{name}-pg"


def connect(address: str, log_to_driver: bool = False, runtime_env: dict | None = None) -> None:
    """Connect this process to the cluster at `address` (HOST:PORT or "auto"), in NAMESPACE.

    The process's SIGTERM handler is kept: ray.init installs its own (in `ray bench` the driver
    aborted with a stack dump, and no `finally` ran: its local cluster was left running).
    """
    import ray

    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=log_to_driver,
            runtime_env=runtime_env,
        )
    except ConnectionError as err:
        raise ConnectionError(
            f"{err} (a cluster with token authentication needs RAY_AUTH_MODE=token and its token in "
            "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        ) from err
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def up(config: RayDeployConfig, log: Callable[[str], None] = lambda msg: None) -> Deployment:
    """Create the deployment; on any failure, remove what was created and raise."""
    import ray
    from ray.util.placement_group import placement_group

    # Ray warns that removing the placement group kills its restartable detached actors: that
    # is what `down` means to do, and the actors restart in their bundles until then.
    logging.getLogger("ray.actor").addFilter(_drop_pg_warning)
    name = config.name
    if _find_actor(actor_name(name, "orchestrator")) or _find_pg(name):
        raise RuntimeError(f"a deployment named {name!r} is already up: run `specdec ray down --name {name}` first")
    bundles = [config.draft_resources.bundle(), config.target_resources.bundle()]
    strategy = PLACEMENTS[config.placement]
    nodes = live_nodes()
    why = unplaceable(bundles, config.placement, nodes)
    if why:  # Ray would wait placement_timeout for it, saying nothing
        raise RuntimeError(
            f"cannot place draft {amounts(bundles[0])} and target {amounts(bundles[1])} with {config.placement} "
            f"({strategy}): {why}; the cluster has {describe_nodes(nodes)}: ask less (--draft-cpus, --target-cpus, "
            "--target-gpus ...), place them otherwise (--placement), or add nodes"
        )
    t0 = time.perf_counter()
    try:
        pg = placement_group(bundles, strategy=strategy, name=pg_name(name), lifetime="detached")
        if not pg.wait(config.placement_timeout):
            raise RuntimeError(  # it fits the cluster, but other work holds what it needs
                f"cannot place draft {amounts(bundles[0])} and target {amounts(bundles[1])} with "
                f"{config.placement} ({strategy}) within {config.placement_timeout:.0f} s: the cluster has "
                f"{describe_nodes(live_nodes())}, some of it held by other work"
            )
        log(f"specdec: placement group {pg_name(name)} ready ({config.placement}: {strategy})")
        orchestrator_name = actor_name(name, "orchestrator")  # watched by the target: nothing else would
        services = start_services(
            config, pg, lambda role: actor_name(name, role), watch=orchestrator_name, lifetime="detached"
        )
        for role, where in started(services, config.start_timeout).items():
            log(f"specdec: {role} service ready at {where['endpoint']} (node {where['node_id'][:12]})")
        orchestrator = (
            ray.remote(OrchestratorHost)
            .options(
                name=orchestrator_name,
                lifetime="detached",
                max_restarts=-1,
                max_task_retries=-1,
                num_cpus=config.orchestrator_cpus,
                resources={HEAD_RESOURCE: 0.001} if config.orchestrator_on_head else None,
            )
            .remote(
                services["draft"],
                services["target"],
                config.port,
                config.orchestrator,
                config.server_security,
                config.service_security,
                config.loopback,
                config.health_timeout,
            )
        )
        where = started({"orchestrator": orchestrator}, config.start_timeout)["orchestrator"]
        address = where["endpoint"]
    except BaseException:
        down(name)
        raise
    log(f"specdec: deployment {name!r} up in {time.perf_counter() - t0:.1f} s; orchestrator at {address}")
    if where.get("http_url"):
        log(f"specdec: OpenAI-compatible API at {where['http_url']}/v1, playground at {where['http_url']}/")
    return Deployment(name, address, where.get("http_url"))


def start_services(
    config: RayDeployConfig, group, name: Callable[[str], str], watch: str | None = None, **options
) -> dict:
    """The draft and the target service actors (not waited for), each in its bundle of the
    placement group (0: the draft's, 1: the target's), named name(role), restarted by Ray up to
    config.max_restarts; `watch`: the orchestrator actor's name, for the target to kill it when it
    hangs (config.health_timeout); `options`: more of Ray's actor options (lifetime, namespace)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    services = {}
    for bundle, (service, res) in enumerate(
        [(config.draft, config.draft_resources), (config.target, config.target_resources)]
    ):
        services[service.role] = (
            ray.remote(ModelServiceHost)
            .options(
                name=name(service.role),
                max_restarts=config.max_restarts,
                max_task_retries=-1,
                num_cpus=res.cpus,
                num_gpus=res.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
                **options,
            )
            .remote(
                service,
                services_security(config),
                config.loopback,
                watch if service.role == "target" else None,
                config.health_timeout,
            )
        )
    return services


def services_security(config: RayDeployConfig) -> ServerSecurity:
    """The model services' security: the deployment's TLS, and as token the one the orchestrator
    sends them (not the clients': see the module doc)."""
    return dataclasses.replace(config.server_security, token=config.service_security.token)


def down(name: str, grace: float = 5.0) -> list[str]:
    """Stop the deployment's actors (calls in flight get `grace` seconds, telemetry is flushed),
    kill them and remove their placement group; returns what was removed."""
    import ray
    from ray.util.placement_group import remove_placement_group

    handles = {role: _find_actor(actor_name(name, role)) for role in ROLES}
    stopping = [h.stop.remote(grace) for h in handles.values() if h is not None]
    if stopping:  # best effort: an actor may be down or restarting
        ray.wait(stopping, num_returns=len(stopping), timeout=grace + 5)
    removed = []
    for role, handle in handles.items():
        if handle is not None:
            ray.kill(handle, no_restart=True)
            removed.append(actor_name(name, role))
    pg = _find_pg(name)
    if pg is not None:
        remove_placement_group(pg)
        removed.append(pg_name(name))
    return removed


@dataclass(frozen=True)
class ActorStatus:
    role: str
    state: str  # Ray's actor state (ALIVE, RESTARTING, ...) or ABSENT
    node_id: str = ""
    node_ip: str = ""
    endpoint: str = ""
    pid: int = 0
    restarts: int = 0
    # whether an ALIVE actor answered the call for its endpoint in time (None: not asked); one that
    # did not is stopped, hung or busy past the probe (its watch kills it after --health-timeout)
    answering: bool | None = None

    @property
    def shown_state(self) -> str:
        return f"{self.state} (not answering)" if self.answering is False else self.state


def status(name: str, probe_seconds: float = 5.0) -> list[ActorStatus]:
    """Each actor of the deployment: its state, node, gRPC endpoint, pid and restarts."""
    import ray

    node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    out = []
    for role in ROLES:
        handle = _find_actor(actor_name(name, role))
        out.append(
            describe(handle, role, node_ips, probe_seconds=probe_seconds) if handle else ActorStatus(role, "ABSENT")
        )
    return out


def describe(
    handle, role: str, node_ips: dict[str, str], endpoint: bool = True, probe_seconds: float = 5.0
) -> ActorStatus:
    """An actor's status from GCS's actor table; `endpoint`: ask it for its gRPC endpoint
    (one of deploy.ray_actors' hosts) when it is alive."""
    import ray

    record = actor_record(handle)
    if record is None:
        return ActorStatus(role, "ABSENT")
    where, answering = "", None
    if endpoint and record["State"] == "ALIVE":
        try:
            where, answering = ray.get(handle.endpoint.remote(), timeout=probe_seconds), True
        except ray.exceptions.GetTimeoutError:
            answering = False
        except Exception:  # noqa: BLE001 - status reports what it can; the state says the rest
            where = "?"
    node_id = record["Address"]["NodeID"]
    node_ip = node_ips.get(node_id, "")
    return ActorStatus(role, record["State"], node_id, node_ip, where, record["Pid"], record["NumRestarts"], answering)


def placement(name: str) -> str:
    """The deployment's placement strategy as Ray holds it ("" when it has no placement group)."""
    from ray.util.placement_group import placement_group_table

    pg = _find_pg(name)
    return placement_group_table(pg).get("strategy", "") if pg is not None else ""


def started(actors: dict, timeout: float) -> dict[str, dict]:
    """Wait for each actor's constructor; its `where()`, or an error naming the role and cause."""
    import ray

    refs = {role: handle.where.remote() for role, handle in actors.items()}
    deadline = time.monotonic() + timeout
    out = {}
    for role, ref in refs.items():
        try:
            out[role] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the {role} actor did not start within {timeout:.0f} s") from None
        except ray.exceptions.RayActorError as err:
            lines = [line for line in str(err).splitlines() if line.strip()]
            raise RuntimeError(f"the {role} actor failed to start: {lines[-1] if lines else err}") from None
    return out


# -- helpers -------------------------------------------------------------------------------
def _drop_pg_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Scheduling a restartable detached actor with a placement group")


def _find_actor(name: str):
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def _find_pg(name: str):
    import ray

    try:
        pg = ray.util.get_placement_group(pg_name(name))
    except ValueError:
        return None
    return pg if ray.util.placement_group_table(pg).get("state") != "REMOVED" else None


def unplaceable(bundles: list[dict[str, float]], placement: str, nodes: list[dict[str, float]]) -> str:
    """Why no node (each a node's total resources) can ever hold the pair's bundles (draft's,
    target's) placed so: `pack`, one node both; `spread`, two different nodes. "" where some can."""

    def fits(node: dict[str, float], *need: dict[str, float]) -> bool:
        return all(node.get(k, 0.0) + 1e-9 >= sum(b.get(k, 0.0) for b in need) for b in need for k in b)

    if placement == "pack":
        return "" if any(fits(n, *bundles) for n in nodes) else "no node has both"
    pairs = ((a, b) for i, a in enumerate(nodes) for j, b in enumerate(nodes) if i != j)
    return "" if any(fits(a, bundles[0]) and fits(b, bundles[1]) for a, b in pairs) else "no two nodes have them"


def amounts(bundle: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items())


def live_nodes() -> list[dict[str, float]]:
    """Each live node's total resources (Ray's table; a connected driver)."""
    import ray

    return [n["Resources"] for n in ray.nodes() if n["Alive"]]


def describe_nodes(nodes: list[dict[str, float]]) -> str:
    parts = [", ".join(f"{k} {v:g}" for k, v in sorted(n.items()) if k in ("CPU", "GPU")) for n in nodes]
    return f"{len(nodes)} node(s): " + "; ".join(f"[{p}]" for p in parts)
