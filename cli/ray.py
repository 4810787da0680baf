"""`specdec ray up|down|status`: the command-line side of deploy.ray_deploy.

Ray is imported only when a command runs (deploy.ray_deploy and deploy.ray_cluster import
it inside their functions), so `specdec --help` and the client path stay light. Without
--address, `up` starts a local cluster (deploy.ray_cluster) and records it in
$SPECDEC_CACHE/ray/NAME.json, where `status` and `down` find it; its actors bind loopback.
`up` takes the same TLS, token and limit flags as the services run by `specdec serve`, and
the same composition (deploy.hosting) builds them.

With --replicas (or --min-replicas and --max-replicas) `up` deploys a Ray Serve application
instead (deploy.ray_serve): that many pairs behind one gRPC and one HTTP address. Its flags
also make a Serve config file (--serve-config), whose application serve_application builds
from them again where Serve runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

from cli import options
from deploy import ray_cluster, ray_deploy
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec.weights import models

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
  specdec ray up --replicas 4 --http-port 8000                 # 4 pairs behind one gRPC (50051) and HTTP address
  specdec ray up --min-replicas 1 --max-replicas 8               # pairs added and removed by Ray Serve under load
  specdec ray up --address auto --replicas 2 --allow-insecure --serve-config serve.yaml   # for `serve deploy`
  specdec ray status
  specdec ray down
"""

SERVE_FLAGS = ("replicas", "min_replicas", "max_replicas")  # any of them: a Serve application
# What a config file's flags leave out: the file itself, this command's output, and the runtime_env
# (the file's application entry has its own).
NOT_IN_CONFIG = {"serve_config", "quiet", "no_dashboard", "runtime_env", "ray_command", "command", "up_parser"}


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
        help="let Ray place the orchestrator on any node (default: the head node; with --replicas each pair's "
        "orchestrator runs beside its draft, whatever this flag)",
    )
    up.add_argument(
        "--port",
        type=options.port_number,
        default=50051,
        help="orchestrator port; 0 picks a free one (default 50051); with --replicas, Serve's gRPC proxy's, "
        "which has no TLS: served on a local cluster or with --allow-insecure, else only the HTTP port",
    )
    up.add_argument(
        "--http-port",
        type=options.port_number,
        help="the orchestrator's OpenAI-compatible HTTP API on this port (default: off); with --replicas, Serve's "
        "HTTP proxy's (default 8000)",
    )
    scale = up.add_argument_group("many pairs behind one address (Ray Serve)")
    scale.add_argument(
        "--replicas", type=int, help="deploy a Ray Serve application of N pairs behind one gRPC and HTTP address"
    )
    scale.add_argument("--min-replicas", type=int, help="with --max-replicas: Serve adds and removes pairs under load")
    scale.add_argument("--max-replicas", type=int, help="the most pairs Serve scales to")
    scale.add_argument(
        "--target-ongoing",
        type=float,
        help="requests in flight per pair that autoscaling aims at (default: half of --max-concurrent)",
    )
    scale.add_argument(
        "--serve-config",
        type=Path,
        metavar="FILE",
        help="write the Serve config file of this deployment (for `serve deploy` or a KubeRay RayService) and exit",
    )
    up.add_argument("--max-restarts", type=int, default=-1, help="restarts per service actor; -1: no limit (default)")
    options.add_health_timeout_flag(up, "an actor")
    up.add_argument("--runtime-env", type=json.loads, help="Ray runtime_env (JSON), e.g. to install specdec")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the services to start")
    up.add_argument("--no-dashboard", action="store_true", help="local cluster only: start it without the dashboard")
    up.add_argument("--quiet", action="store_true", help="print only the orchestrator address")
    options.add_backend_flag(up, "target-")
    options.add_drafter_flag(up)
    options.add_server_security_flags(up)
    options.add_client_security_flags(up, "service-", "the model services", starts_services=True)
    options.add_limit_flags(up, "all")
    options.add_overlap_flag(up)
    options.add_rule_flag(up)
    options.add_tree_flag(up)
    options.add_lookahead_flag(up, client=False)
    up.set_defaults(up_parser=up)  # config_flags reads back which flags were given

    down = rsub.add_parser("down", help="remove what `ray up` created (and the local cluster it started)")
    _add_cluster_flags(down)
    _add_bench_parser(rsub)
    st = rsub.add_parser(
        "status", help="each actor (each Serve replica and its services): state, node, endpoint, pid, restarts"
    )
    _add_cluster_flags(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    return up


def _add_bench_parser(rsub) -> None:
    from bench.serve_scaling import ScalingConfig  # light: a dataclass and its defaults

    d = ScalingConfig()
    b = rsub.add_parser(
        "bench",
        help="tokens/s of 1, 2, 4, 8 pairs behind one Serve endpoint (sleeping stand-ins), and its overhead",
        description="On a local Ray cluster of its own: pairs of stand-in models whose forwards sleep (no core "
        "used, as beside an accelerator) behind one Ray Serve endpoint, under a load that fills every pair; total "
        "tokens/s for each pair count, then the latency one request gains through Serve against one orchestrator "
        "called directly. Prints a markdown table. Run it on a quiet machine.",
    )
    b.add_argument("--replicas", default=",".join(map(str, d.replicas)), help="comma list of pair counts")
    b.add_argument(
        "--max-concurrent", type=options.positive, default=d.max_concurrent, help="generations a pair runs at once"
    )
    b.add_argument(
        "--clients-per-replica", type=options.positive, help="clients per pair (default: --max-concurrent + 1)"
    )
    b.add_argument("--duration", type=float, default=d.duration, help="seconds measured per row")
    b.add_argument("--warmup", type=float, default=d.warmup, help="seconds of load before each row's window")
    b.add_argument("--max-tokens", type=options.positive, default=d.max_tokens, help="tokens a request")
    b.add_argument("--lookahead", type=options.positive, default=d.lookahead, help="draft tokens a round")
    b.add_argument("--draft-ms", type=float, default=d.draft_ms, help="the draft stand-in's forward, ms")
    b.add_argument("--target-ms", type=float, default=d.target_ms, help="the target stand-in's forward, ms")
    b.add_argument(
        "--agreement", type=float, default=d.agreement, help="how often the draft proposes the target's token"
    )
    b.add_argument(
        "--overhead-requests", type=options.positive, default=d.overhead_requests, help="requests per path, one client"
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="Ray cluster address (HOST:PORT or auto); default: the local cluster `up` started")
    p.add_argument("--name", default="specdec", help="deployment name (default specdec)")


def run(args) -> int:
    return {"up": cmd_up, "down": cmd_down, "status": cmd_status, "bench": cmd_bench}[args.ray_command](args)


def _state_file(name: str) -> Path:
    return models.cache_dir() / "ray" / f"{name}.json"


def _log(args):
    quiet = getattr(args, "quiet", False)
    return (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))


def _threads(cpus: float, threads: int | None, role: str) -> int | None:
    """An actor's threads: --ROLE-threads, else the CPUs Ray reserves for it (Ray does not pin cores)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--{role}-threads must be >= 1, got {threads}")
        return threads
    return max(1, int(cpus)) if cpus > 0 else None


def _device(device: str | None, gpus: float) -> str:
    return device or ("cuda:0" if gpus > 0 else "cpu")


def pair_config(args) -> ray_deploy.RayDeployConfig:
    """One pair, from `up`'s flags: the whole deployment, or each replica of a Serve one. It
    secures its servers and the orchestrator's service links as `orchestrator` does (TLS,
    mTLS, token; plaintext on the cluster's network only if allowed)."""
    # The actors bind their nodes' addresses, and get a fixed copy (no SIGHUP reload inside Ray).
    server_security = options.server_security(args, check_host=False, reloadable=False)
    limits = options.session_limits(args)
    return ray_deploy.RayDeployConfig(
        name=args.name,
        target=ModelServiceConfig(
            "target",
            models.ModelSpec(args.target_model, _device(args.target_device, args.target_gpus), args.target_dtype),
            limits=limits,
            threads=_threads(args.target_cpus, args.target_threads, "target"),
            backend=args.target_backend,
        ),
        draft=ModelServiceConfig(
            "draft",
            models.ModelSpec(args.draft_model, _device(args.draft_device, args.draft_gpus), args.draft_dtype),
            args.drafter,
            limits,
            threads=_threads(args.draft_cpus, args.draft_threads, "draft"),
        ),
        target_resources=ray_deploy.Resources(args.target_cpus, args.target_gpus),
        draft_resources=ray_deploy.Resources(args.draft_cpus, args.draft_gpus),
        placement=args.placement,
        orchestrator=OrchestratorConfig(
            admission=options.admission_limits(args),
            http_port=args.http_port,
            **options.request_defaults(args),
        ),
        orchestrator_cpus=args.orchestrator_cpus,
        orchestrator_on_head=not args.orchestrator_anywhere,
        port=args.port,
        max_restarts=args.max_restarts,
        health_timeout=args.health_timeout,
        start_timeout=args.timeout,
        server_security=server_security,
        service_security=options.service_client_security(args, server_security, starts_services=True),
        loopback=not args.address,  # a local cluster is this machine
    )


def serve_config(args):
    """A Serve deployment (deploy.ray_serve.ServeConfig) from `up`'s flags."""
    from deploy.ray_serve import ServeConfig

    pair = pair_config(args)
    pair = replace(pair, orchestrator=replace(pair.orchestrator, http_port=None))  # the door serves HTTP
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    return ServeConfig(
        pair,
        replicas=1 if args.replicas is None else args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing=args.target_ongoing,
        grpc_port=args.port or ray_cluster.free_port(),
        http_port=(args.http_port if args.http_port is not None else 8000) or ray_cluster.free_port(),
        http_tls=tls,
        runtime_env=args.runtime_env,
    )


def serve_application(args: dict):
    """The application of a Serve config file written by `specdec ray up --serve-config`: `up`'s
    flags (args["flags"]) parsed again and built where Serve builds it (the TLS files and the
    token are read there)."""
    from deploy import ray_serve

    parser = argparse.ArgumentParser(prog="specdec")
    add_parser(parser.add_subparsers(dest="command", required=True))  # `specdec ray`'s own flags
    parsed = parser.parse_args(["ray", "up", *shlex.split(args["flags"])])
    if not _serves(parsed):
        raise ValueError("a Serve config file's flags need --replicas, or --min-replicas and --max-replicas")
    return ray_serve.application(serve_config(parsed))


def config_flags(args, parser: argparse.ArgumentParser) -> str:
    """`up`'s flags that `args` sets to other than their defaults (what a config file repeats)."""
    flags = []
    for action in parser._actions:  # argparse keeps no other list of a parser's flags
        value = getattr(args, action.dest, None)
        if action.default == argparse.SUPPRESS or not action.option_strings or action.dest in NOT_IN_CONFIG:
            continue
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        flags += [flag] if action.nargs == 0 else [flag, str(value)]
    return shlex.join(flags)


def cmd_up(args) -> int:
    serves = _serves(args)
    if serves:
        config = serve_config(args)
        if args.serve_config:
            from deploy import ray_serve

            flags = config_flags(args, args.up_parser)
            args.serve_config.write_text(_yaml(ray_serve.config_file(config, flags)))
            print(f"specdec: wrote {args.serve_config}: `serve deploy {args.serve_config}` deploys it", file=sys.stderr)
            return 0
    elif args.serve_config or args.target_ongoing is not None:
        raise ValueError("--serve-config and --target-ongoing are for a Serve deployment: give --replicas")
    else:
        config = pair_config(args)
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
        if serves:
            from deploy import ray_serve

            deployment = ray_serve.up(config, log)
            address = deployment.grpc_address or deployment.http_url
        else:
            address = ray_deploy.up(config, log).address
    except BaseException:
        if cluster is not None:
            ray_cluster.stop(cluster, state)
        raise
    print(address, flush=True)
    return 0


def _serves(args) -> bool:
    return any(getattr(args, flag) is not None for flag in SERVE_FLAGS)


def _yaml(doc: dict) -> str:
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, width=120)


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

    from deploy import ray_serve

    removed = ray_serve.down(args.name) + ray_deploy.down(args.name)
    ray.shutdown()
    print(f"specdec: removed {', '.join(removed)}" if removed else f"specdec: nothing named {args.name!r} was up")
    if cluster is not None:
        ray_cluster.stop(cluster, state)
        print(f"specdec: stopped the local Ray cluster at {cluster.address}")
    return 0


def cmd_status(args) -> int:
    _connect_existing(args)
    from deploy import ray_serve

    if ray_serve.exists(args.name):
        return _serve_status(args, *ray_serve.status(args.name))
    rows = ray_deploy.status(args.name)
    placement = ray_deploy.placement(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "placement": placement, "actors": [asdict(r) for r in rows]}))
        return 0
    print(f"deployment {args.name}: placement {placement or '-'}")
    _table([("", r) for r in rows])
    return 0


def _serve_status(args, state: str, replicas) -> int:
    """A Serve deployment: the application's state, then each replica and its services."""
    if args.json:
        report = [{"replica": r.id, **asdict(r.actor), "services": [asdict(s) for s in r.services]} for r in replicas]
        print(json.dumps({"name": args.name, "serve": state, "replicas": report}))
        return 0
    pairs = sum(r.actor.role == "pair" for r in replicas)
    print(f"deployment {args.name}: Serve application {state}, {pairs} pair replica(s)")
    _table([(r.id, a) for r in replicas for a in (r.actor, *r.services)])
    return 0


def _table(rows) -> None:
    """(replica id or "", ray_deploy.ActorStatus) rows as a table; the REPLICA column only if any has one."""
    table = [("REPLICA", "ROLE", "STATE", "NODE", "NODE IP", "ENDPOINT", "PID", "RESTARTS")]
    table += [
        (replica, r.role, r.shown_state, r.node_id[:12], r.node_ip, r.endpoint, str(r.pid or ""), str(r.restarts))
        for replica, r in rows
    ]
    if not any(replica for replica, _ in rows):
        table = [row[1:] for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def cmd_bench(args) -> int:
    from bench import serve_scaling

    config = serve_scaling.ScalingConfig(
        replicas=tuple(int(n) for n in args.replicas.split(",") if n),
        max_concurrent=args.max_concurrent,
        clients_per_replica=args.clients_per_replica,
        duration=args.duration,
        warmup=args.warmup,
        max_tokens=args.max_tokens,
        lookahead=args.lookahead,
        draft_ms=args.draft_ms,
        target_ms=args.target_ms,
        agreement=args.agreement,
        overhead_requests=args.overhead_requests,
    )
    report = serve_scaling.run(config, _state_file("bench"), _log(args))
    print(json.dumps(report.as_dict()) if args.json else report.text())
    return 0
