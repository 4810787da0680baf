"""specdec on Ray Serve: many pairs behind one endpoint, autoscaled; a lost replica loses nothing.

A Serve deployment named N is a Serve application N of two deployments (what runs in their
replicas: deploy.serve_replicas; how the cluster has them, which `status` and the door's health
report: deploy.serve_status):
- `Pair`: a replica is a pair, its draft and target in the replica's placement group (`pack`
  or `spread`, as deploy.ray_deploy places one pair) and its orchestrator in the replica.
  `replicas` of them, or from `min_replicas` to `max_replicas` scaled by Serve on the requests
  ongoing per replica (`target_ongoing`); each takes `max_concurrent` generations at once.
- `Door`: the one endpoint. Serve's gRPC proxy (Generate, GenerateStream, with the project's
  protos) and HTTP proxy (the OpenAI-compatible API, GET /health) on the head node reach it;
  it checks the token, sends each request to the pair with the fewest ongoing, and finishes a
  request whose pair died on another (orchestrator.continuation).

The proxies are Serve's, one set per cluster (serve_options): the first Serve deployment on a
cluster sets their ports. Serve's HTTP proxy takes the deployment's TLS certificate (as files,
read on the head node); its gRPC proxy (Ray 2.60) has no TLS and listens on every interface,
so beyond a local cluster it opens only where plaintext is allowed (`allow_insecure`; the door
still checks the token), and the HTTPS endpoint is the one endpoint otherwise.

The same application is built from the CLI (`specdec ray up --replicas`) and from a Serve
config file (`serve deploy`, a KubeRay RayService): config_file() writes one whose application
is built by `cli.ray:serve_application` from the same flags. This module expects a connected
driver for up/down/status; it reads no argv or environment, and imports Ray Serve only in them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy import serve_status
from deploy.ray_deploy import PLACEMENTS, RayDeployConfig, amounts, describe_nodes, live_nodes, unplaceable
from specdec.limits import AdmissionLimits, ResumePolicy
from specdec.serving.security import SecurityError

LOOPBACK = "127.0.0.1"
SERVICER = "specdec.v1.orchestrator_pb2_grpc.add_OrchestratorServicer_to_server"  # what the gRPC proxy serves
BUILDER = "cli.ray:serve_application"  # the import path of a config file's application
# The application's replicas as the cluster has them (deploy.serve_status: the door reads them too).
Replica = serve_status.Replica
status = serve_status.status


@dataclass(frozen=True)
class ServeConfig:
    pair: RayDeployConfig  # one pair: models, resources, placement, orchestrator, security (its port unused)
    replicas: int = 1  # pairs, when min_replicas/max_replicas are unset
    min_replicas: int | None = None  # set both: Serve scales between them
    max_replicas: int | None = None
    target_ongoing: float | None = (
        None  # requests ongoing per replica that autoscaling aims at; None: max_concurrent / 2
    )
    grpc_port: int = 50051  # Serve's gRPC proxy
    http_port: int = 8000  # Serve's HTTP proxy
    http_tls: tuple[Path, Path] | None = None  # (certificate, key) files of the HTTP proxy, on the head node
    route_prefix: str = "/"
    doors: int = 1
    resume: ResumePolicy = field(default_factory=ResumePolicy)
    health_check_period: float = 10.0  # seconds between Serve's checks of a replica
    upscale_delay: float = 30.0  # seconds a higher load lasts before Serve adds replicas (Serve's default)
    downscale_delay: float = 600.0  # seconds a lower load lasts before it removes one (Serve's default)
    metrics_interval: float = 10.0  # seconds between a replica's reports of its load (Serve's default)
    runtime_env: dict | None = None

    def __post_init__(self):
        scaled = (self.min_replicas, self.max_replicas)
        if (scaled[0] is None) != (scaled[1] is None):
            raise ValueError("give both --min-replicas and --max-replicas (Serve scales between them), or --replicas")
        if self.autoscaled and not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas == 0:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and 1 <= --max-replicas, got {scaled}")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.target_ongoing is not None and not self.target_ongoing > 0:
            raise ValueError(f"--target-ongoing must be > 0, got {self.target_ongoing}")
        if not (0 < self.grpc_port < 65536 and 0 < self.http_port < 65536) or self.grpc_port == self.http_port:
            raise ValueError(
                f"the gRPC and HTTP ports must be two ports in 1..65535, got {self.grpc_port} and {self.http_port}"
            )
        if self.pair.server_security.tls and self.http_tls is None:
            raise SecurityError("Serve's HTTP proxy reads its TLS certificate from files: give their paths")

    @property
    def grpc_door(self) -> bool:
        """Whether Serve's gRPC proxy serves the API: it has no TLS (Ray 2.60) and listens on every
        interface, so beyond a local cluster only where plaintext is allowed (the door still
        checks the token)."""
        return self.pair.loopback or self.pair.server_security.allow_insecure

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.autoscaled else self.replicas


def serve_options(config: ServeConfig) -> dict:
    """serve.start's options for the proxies (and a config file's top level)."""
    http = {"host": LOOPBACK if config.pair.loopback else "0.0.0.0", "port": config.http_port}
    if config.http_tls is not None:
        http |= {"ssl_certfile": str(config.http_tls[0]), "ssl_keyfile": str(config.http_tls[1])}
    return {
        "proxy_location": "HeadOnly",  # one endpoint, on the head, as the single-pair orchestrator
        "http_options": http,
        # No servicer: Serve starts no gRPC server.
        "grpc_options": {"port": config.grpc_port, "grpc_servicer_functions": [SERVICER] if config.grpc_door else []},
    }


def config_file(config: ServeConfig, flags: str) -> dict:
    """A Serve config file (`serve deploy`, a RayService's serveConfigV2) for the application
    that `specdec ray up FLAGS` deploys: cli.ray:serve_application builds it from FLAGS where
    Serve builds applications, reading the TLS files and the token there."""
    app = {"name": config.pair.name, "route_prefix": config.route_prefix, "import_path": BUILDER}
    app["args"] = {"flags": flags}
    if config.runtime_env:
        app["runtime_env"] = config.runtime_env
    app["deployments"] = [{"name": "Pair", **scaling(config)}]  # what to edit to rescale (overrides the flags)
    return {**serve_options(config), "applications": [app]}


def scaling(config: ServeConfig) -> dict:
    """The Pair deployment's replica options: a count, or Serve's autoscaling between two."""
    if not config.autoscaled:
        return {"num_replicas": config.replicas}
    target = config.target_ongoing or max(1.0, config.pair.orchestrator.admission.max_concurrent / 2)
    return {
        "autoscaling_config": {
            "min_replicas": config.min_replicas,
            "max_replicas": config.max_replicas,
            "target_ongoing_requests": target,
            "upscale_delay_s": config.upscale_delay,
            "downscale_delay_s": config.downscale_delay,
            "metrics_interval_s": config.metrics_interval,
            "look_back_period_s": max(2 * config.metrics_interval, 1.0),
        }
    }


def application(config: ServeConfig):
    """The Serve application (Door bound to Pair) for `config`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deploy import serve_replicas

    pair = config.pair
    admission = pair.orchestrator.admission
    bundles = pair_bundles(pair)
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    pairs = serve.deployment(
        serve_replicas.Pair,
        name="Pair",
        ray_actor_options={"num_cpus": pair.orchestrator_cpus},
        placement_group_bundles=bundles,
        placement_group_strategy=PLACEMENTS[pair.placement],
        max_ongoing_requests=admission.max_concurrent,
        max_constructor_retry_count=3,
        health_check_period_s=config.health_check_period,
        graceful_shutdown_timeout_s=60.0,
        request_router_config=RequestRouterConfig(request_router_class="deploy.serve_replicas:LeastOutstanding"),
        logging_config=quiet,
        **scaling(config),
    ).bind(pair)
    door_config = serve_replicas.DoorConfig(
        pair.name,
        pair.server_security,
        pair.service_security,
        # Everything the pairs take at once, and the queue in front of them.
        AdmissionLimits(config.most_replicas * admission.max_concurrent, admission.max_queue),
        config.resume,
        pair.start_timeout,
    )
    door = serve.deployment(
        serve_replicas.Door,
        name="Door",
        num_replicas=config.doors,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=door_config.admission.max_concurrent + admission.max_queue + 8,
        logging_config=quiet,
    )
    return door.bind(pairs, door_config)


def pair_bundles(pair: RayDeployConfig) -> list[dict[str, float]]:
    """A pair's placement group: the replica (its orchestrator) with the draft, and the target."""
    return [_bundle(pair.draft_resources.bundle(), {"CPU": pair.orchestrator_cpus}), pair.target_resources.bundle()]


def check_fits(config: ServeConfig, nodes: list[dict[str, float]] | None = None) -> None:
    """Refuse at once a deployment the cluster cannot place (Serve would wait for it without an
    error, saying every 30 s that a replica has not been scheduled): a pair that no node (pack) or
    no two nodes (spread) can hold, or pairs (the replicas it starts with) that need more than the
    cluster has, against `nodes` (each live node's total resources: Ray's, by default)."""
    nodes = live_nodes() if nodes is None else nodes
    pair = config.pair
    count = config.min_replicas if config.autoscaled else config.replicas
    bundles = pair_bundles(pair)
    each = _bundle(*bundles)
    why = unplaceable(bundles, pair.placement, nodes) if count else ""
    if why:
        raise RuntimeError(
            f"the cluster cannot place a pair: draft and orchestrator {amounts(bundles[0])}, target "
            f"{amounts(bundles[1])} with {pair.placement} ({PLACEMENTS[pair.placement]}): {why}; the cluster has "
            f"{describe_nodes(nodes)}: ask less a pair (--draft-cpus, --target-cpus, --target-gpus ...), place "
            "them otherwise (--placement), or add nodes"
        )
    cluster = _bundle(*nodes)
    short = {k: v * count for k, v in each.items() if v * count > cluster.get(k, 0.0) + 1e-9}
    if short:
        need = ", ".join(f"{v:g} {k}" for k, v in short.items())
        has = ", ".join(f"{cluster.get(k, 0.0):g} {k}" for k in short)
        raise RuntimeError(
            f"the cluster cannot place {count} pair(s): they need {need} ({amounts(each)} a pair), the cluster has "
            f"{has}; give fewer --replicas (--min-replicas), fewer resources a pair (--draft-cpus, --target-cpus, "
            "--target-gpus ...), or add nodes"
        )


def _bundle(*parts: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return {k: v for k, v in out.items() if v > 0}


@dataclass(frozen=True)
class ServeDeployment:
    name: str
    grpc_address: str | None  # HOST:PORT of Serve's gRPC proxy (None: closed, ServeConfig.grpc_door)
    http_url: str


def up(config: ServeConfig, log: Callable[[str], None] = lambda msg: None) -> ServeDeployment:
    """Start Serve's proxies (if Serve is not running yet) and deploy the application; returns
    once every replica is up. On failure the application is deleted and the error raised."""
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    name = config.pair.name
    if exists(name):
        raise RuntimeError(
            f"a Serve application named {name!r} is already up: run `specdec ray down --name {name}` first"
        )
    check_fits(config)
    t0 = time.perf_counter()
    options = serve_options(config)
    serve.start(**options)
    try:
        serve.run(application(config), name=name, route_prefix=config.route_prefix)
    except RuntimeError as err:
        why = _deployment_messages(name)
        down(name)
        raise RuntimeError(f"{err}{why}") from None
    except BaseException:
        down(name)
        raise
    head = LOOPBACK if config.pair.loopback else _head_ip()
    scheme = "https" if config.http_tls else "http"
    grpc_address = f"{head}:{config.grpc_port}" if config.grpc_door else None
    deployment = ServeDeployment(name, grpc_address, f"{scheme}://{head}:{config.http_port}")
    scale = (
        f"{config.min_replicas}..{config.max_replicas} replicas (autoscaled)"
        if config.autoscaled
        else f"{config.replicas} replica(s)"
    )
    log(f"specdec: Serve application {name!r} up in {time.perf_counter() - t0:.1f} s: {scale} of a pair")
    log(f"specdec: OpenAI-compatible API at {deployment.http_url}/v1")
    if grpc_address:
        log(f"specdec: gRPC at {grpc_address} (Serve's gRPC proxy: plaintext, on every interface)")
    else:
        log("specdec: no gRPC endpoint: Serve's gRPC proxy has no TLS; --allow-insecure opens it in plaintext")
    return deployment


def rescale(config: ServeConfig) -> None:
    """Apply the config's replica counts (or its autoscaling) to the running application: Serve
    keeps the replicas it has and adds or removes pairs; returns once they all run."""
    from ray import serve

    serve.run(application(config), name=config.pair.name, route_prefix=config.route_prefix)


def down(name: str) -> list[str]:
    """Delete the application (its replicas, their placement groups and services); Serve's
    proxies go too once no application is left. Returns what was removed."""
    from ray import serve

    if not exists(name):
        return []
    serve.delete(name)
    removed = [f"Serve application {name}"]
    if not serve.status().applications:
        serve.shutdown()
        removed.append("Serve")
    return removed


def exists(name: str) -> bool:
    from ray import serve

    return serve_status.running() and name in serve.status().applications


# -- helpers -------------------------------------------------------------------------------
def _deployment_messages(name: str) -> str:
    """What Serve says of each deployment of the application that is not healthy (a replica's
    constructor error, a placement that does not fit), as lines to add to an error."""
    from ray import serve

    app = serve.status().applications.get(name)
    lines = [f"{d}: {s.message}" for d, s in (app.deployments if app else {}).items() if s.message]
    return "".join(f"\n  {line}" for line in lines)


def _head_ip() -> str:
    import ray

    from deploy.ray_deploy import HEAD_RESOURCE

    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and HEAD_RESOURCE in n["Resources"])
