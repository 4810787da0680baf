"""`specdec ray up|down|status`: the command-line side of deploy.ray_deploy.

Ray is imported only when a command runs (deploy.ray_deploy and deploy.ray_cluster import
it inside their functions), so `specdec --help` and the client path stay light. Without
--address, `up` starts a local cluster (deploy.ray_cluster) and records it in
$SPECDEC_CACHE/ray/NAME.json, where `status` and `down` find it; its actors bind loopback.
`up` takes the same TLS, token and limit flags as the services run by `specdec serve`, and
the same composition (deploy.hosting) builds them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from cli import options
from deploy import ray_cluster, ray_deploy
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec import models

DESCRIPTION = """\
Run the draft and target services and the orchestrator as Ray actors. The two services get a
placement group: --placement pack puts both on one node (e.g. a GPU pair), spread on two
different nodes (e.g. two hosts). Services that die are restarted by Ray, and a generation in
flight continues where it was.
"""

EPILOG = """\
examples:
  specdec ray up                                        # local Ray cluster (actors on loopback), default pair
  specdec generate "Hi" --address $(specdec ray up --quiet --port 0)
  specdec ray up --address auto --draft-gpus 1 --target-gpus 1 --placement pack --allow-insecure  # a GPU pair
  specdec ray up --address HEAD:6379 --draft-gpus 1 --target-gpus 1 --placement spread \\
      --tls-cert s.pem --tls-key s.key --service-tls-ca ca.pem --service-tls-server-name specdec  # two hosts
  specdec ray status
  specdec ray down
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """Add `ray up|down|status` to the subcommands; returns `up`'s parser, for more flags."""
    r = sub.add_parser("ray", help="run the services as Ray actors: ray up | down | status")
    rsub = r.add_subparsers(dest="ray_command", required=True, metavar="RAY_COMMAND")

    up = rsub.add_parser(
        "up",
        help="start a deployment on a Ray cluster and print the orchestrator address",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_cluster_flags(up)
    for role, dtype in (("target", models.DEFAULT_TARGET_DTYPE), ("draft", models.DEFAULT_DRAFT_DTYPE)):
        up.add_argument(f"--{role}-model", default=models.DEFAULT_ALIAS, help=f"{role} model (default: embedded)")
        up.add_argument(f"--{role}-device", help=f"torch device of the {role} (default cuda:0 with GPUs, else cpu)")
        up.add_argument(f"--{role}-dtype", default=dtype, choices=models.DTYPES, help=f"{role} dtype (default {dtype})")
        up.add_argument(f"--{role}-cpus", type=float, default=1.0, help=f"CPUs reserved for the {role} (default 1)")
        up.add_argument(f"--{role}-gpus", type=float, default=0.0, help=f"GPUs reserved for the {role} (default 0)")
        up.add_argument(
            f"--{role}-threads", type=int, help=f"threads of the {role}'s forwards (default: one per CPU it reserves)"
        )
    up.add_argument(
        "--placement",
        choices=("pack", "spread"),
        default="pack",
        help="pack: both services on one node (STRICT_PACK, default); spread: on two nodes (STRICT_SPREAD)",
    )
    up.add_argument("--orchestrator-cpus", type=float, default=0.0, help="CPUs for the orchestrator (default 0)")
    up.add_argument(
        "--orchestrator-anywhere",
        action="store_true",
        help="let Ray place the orchestrator on any node (default: the head node)",
    )
    up.add_argument("--port", type=int, default=50051, help="orchestrator port; 0 picks a free one (default 50051)")
    up.add_argument(
        "--http-port", type=int, help="the orchestrator's OpenAI-compatible HTTP API on this port (default: off)"
    )
    up.add_argument("--max-restarts", type=int, default=-1, help="restarts per service actor; -1: no limit (default)")
    up.add_argument("--runtime-env", type=json.loads, help="Ray runtime_env (JSON), e.g. to install specdec")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the services to start")
    up.add_argument("--no-dashboard", action="store_true", help="local cluster only: start it without the dashboard")
    up.add_argument("--quiet", action="store_true", help="print only the orchestrator address")
    options.add_backend_flag(up, "target-")
    options.add_drafter_flag(up)
    options.add_server_security_flags(up)
    options.add_client_security_flags(up, "service-", "the model services")
    options.add_limit_flags(up, "all")
    options.add_overlap_flag(up)
    options.add_rule_flag(up)
    options.add_tree_flag(up)

    down = rsub.add_parser("down", help="remove what `ray up` created (and the local cluster it started)")
    _add_cluster_flags(down)
    st = rsub.add_parser("status", help="each actor: state, node, endpoint, pid, restarts")
    _add_cluster_flags(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    return up


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="Ray cluster address (HOST:PORT or auto); default: the local cluster `up` started")
    p.add_argument("--name", default="specdec", help="deployment name (default specdec)")


def run(args) -> int:
    return {"up": cmd_up, "down": cmd_down, "status": cmd_status}[args.ray_command](args)


def _state_file(name: str) -> Path:
    return models.cache_dir() / "ray" / f"{name}.json"


def _log(args):
    quiet = getattr(args, "quiet", False)
    return (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))


def _threads(cpus: float) -> int | None:
    """An actor's threads by default: the CPUs Ray reserves for it (Ray does not pin cores)."""
    return max(1, int(cpus)) if cpus > 0 else None


def _device(device: str | None, gpus: float) -> str:
    return device or ("cuda:0" if gpus > 0 else "cpu")


def cmd_up(args) -> int:
    """`up` secures its three servers and the orchestrator's service links as `orchestrator`
    does (TLS, mTLS, token; plaintext on the cluster's network only if allowed)."""
    # The actors bind their nodes' addresses, and get a fixed copy (no SIGHUP reload inside Ray).
    server_security = options.server_security(args, check_host=False, reloadable=False)
    limits = options.session_limits(args)
    config = ray_deploy.RayDeployConfig(
        name=args.name,
        target=ModelServiceConfig(
            "target",
            models.ModelSpec(args.target_model, _device(args.target_device, args.target_gpus), args.target_dtype),
            limits=limits,
            threads=args.target_threads or _threads(args.target_cpus),
            backend=args.target_backend,
        ),
        draft=ModelServiceConfig(
            "draft",
            models.ModelSpec(args.draft_model, _device(args.draft_device, args.draft_gpus), args.draft_dtype),
            args.drafter,
            limits,
            threads=args.draft_threads or _threads(args.draft_cpus),
        ),
        target_resources=ray_deploy.Resources(args.target_cpus, args.target_gpus),
        draft_resources=ray_deploy.Resources(args.draft_cpus, args.draft_gpus),
        placement=args.placement,
        orchestrator=OrchestratorConfig(
            admission=options.admission_limits(args),
            overlap=not args.no_overlap,
            rule=args.rule,
            tree_nodes=args.tree,
            http_port=args.http_port,
        ),
        orchestrator_cpus=args.orchestrator_cpus,
        orchestrator_on_head=not args.orchestrator_anywhere,
        port=args.port,
        max_restarts=args.max_restarts,
        start_timeout=args.timeout,
        server_security=server_security,
        service_security=options.service_client_security(args, server_security, starts_services=True),
        loopback=not args.address,  # a local cluster is this machine
    )
    log = _log(args)
    state = _state_file(args.name)
    cluster = None
    address = args.address
    if not address:
        if ray_cluster.load(state) is not None:
            raise RuntimeError(f"a local cluster for {args.name!r} is already running: `specdec ray down` first")
        os.environ.update(ray_cluster.auth_env(dict(os.environ)))
        log("specdec: starting a local Ray cluster")
        cluster = ray_cluster.start(state, dict(os.environ), dashboard=not args.no_dashboard)
        address = cluster.address
    try:
        ray_deploy.connect(address, log_to_driver=not args.quiet, runtime_env=args.runtime_env)
        deployment = ray_deploy.up(config, log)
    except BaseException:
        if cluster is not None:
            ray_cluster.stop(cluster, state)
        raise
    print(deployment.address, flush=True)
    return 0


def _connect_existing(args) -> tuple[object, Path]:
    """Connect to --address, or to the local cluster `up` started; (that cluster or None, state file).

    Token auth is switched on before ray is first imported: Ray reads RAY_AUTH_MODE then.
    """
    state = _state_file(args.name)
    cluster = None if args.address else ray_cluster.load(state)
    if not args.address and cluster is None:
        raise RuntimeError(f"no --address, and no local cluster started by `specdec ray up --name {args.name}`")
    if cluster is not None:
        os.environ.update(ray_cluster.auth_env(dict(os.environ)))
    ray_deploy.connect(args.address or cluster.address)
    return cluster, state


def cmd_down(args) -> int:
    cluster, state = _connect_existing(args)
    import ray  # only now: Ray reads RAY_AUTH_MODE when it is first imported

    removed = ray_deploy.down(args.name)
    ray.shutdown()
    print(f"specdec: removed {', '.join(removed)}" if removed else f"specdec: nothing named {args.name!r} was up")
    if cluster is not None:
        ray_cluster.stop(cluster, state)
        print(f"specdec: stopped the local Ray cluster at {cluster.address}")
    return 0


def cmd_status(args) -> int:
    _connect_existing(args)
    rows = ray_deploy.status(args.name)
    placement = ray_deploy.placement(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "placement": placement, "actors": [asdict(r) for r in rows]}))
        return 0
    print(f"deployment {args.name}: placement {placement or '-'}")
    table = [("ROLE", "STATE", "NODE", "NODE IP", "ENDPOINT", "PID", "RESTARTS")]
    table += [(r.role, r.state, r.node_id[:12], r.node_ip, r.endpoint, str(r.pid or ""), str(r.restarts)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
