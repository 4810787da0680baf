"""The commands that serve: `draft-service`, `target-service`, `orchestrator` (one server in
this process) and `serve` (all three as local processes); signals, drain and the ready file.

deploy.hosting, which imports torch and the models, is imported inside the commands that
host something, so `specdec --help` and the client commands stay light.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from cli import options
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from deploy.local import LOOPBACK, METRICS_OFFSETS, MODEL_SERVICES, LocalPipeline, RestartPolicy
from specdec.runtime import placement
from specdec.runtime.placement import parse_cpus
from specdec.weights import models

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run draft, target and orchestrator locally until interrupted")
    s.add_argument("--host", default="127.0.0.1", help="orchestrator address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=options.port_number, default=50051, help="orchestrator port (default 50051)")
    s.add_argument(
        "--ready-file",
        type=Path,
        help='write {"address", "services", "http_url"} (JSON) here once serving (removed at start and at stop)',
    )
    text = "Prometheus metrics: orchestrator on this port, target +1, draft +2 (0: free ones; default: off)"
    options.add_metrics_flag(s, text, options.metrics_base_port)
    options.add_http_flag(s)
    options.add_overlap_flag(s)
    options.add_rule_flag(s)
    options.add_tree_flag(s)
    options.add_lookahead_flag(s, client=False)
    options.add_pair_flags(s)
    options.add_server_security_flags(s)
    options.add_limit_flags(s, "serve")
    options.add_health_timeout_flag(s, "a process")


def add_service_parsers(sub) -> None:
    d = sub.add_parser("draft-service", help="run the draft model service alone")
    options.add_server_flags(d, 50062)
    options.add_model_flags(d, models.DEFAULT_DRAFT_DTYPE)
    options.add_drafter_flag(d)
    options.add_compile_flag(d)
    options.add_placement_flags(d)
    options.add_server_security_flags(d)
    options.add_limit_flags(d, "model")
    t = sub.add_parser("target-service", help="run the target model service alone")
    options.add_server_flags(t, 50061)
    options.add_model_flags(t, models.DEFAULT_TARGET_DTYPE)
    options.add_compile_flag(t)
    options.add_backend_flag(t)
    options.add_placement_flags(t)
    options.add_server_security_flags(t)
    options.add_limit_flags(t, "model")


def add_orchestrator_parser(sub) -> None:
    o = sub.add_parser("orchestrator", help="run the orchestrator alone, against running services")
    options.add_server_flags(o, 50051)
    o.add_argument("--target-address", type=options.host_port, required=True, help="HOST:PORT of the target service")
    o.add_argument("--draft-address", type=options.host_port, help="HOST:PORT of the draft service (omit: target-only)")
    options.add_http_flag(o)
    options.add_overlap_flag(o)
    options.add_rule_flag(o)
    options.add_tree_flag(o)
    options.add_lookahead_flag(o, client=False)
    options.add_server_security_flags(o)
    options.add_client_security_flags(o, "service-", "the model services")
    options.add_limit_flags(o, "orchestrator")
    o.add_argument(
        "--health-socket",
        metavar="PATH",
        help="also answer gRPC health checks (and nothing else) on this Unix socket: a supervisor's probes "
        "past the TLS of --port (`specdec serve` gives one where the orchestrator serves TLS)",
    )
    o.add_argument(
        "--prices-file",
        metavar="PATH",
        help="keep the pair's prices here: read at start where an orchestrator before this one on the same pair "
        "wrote them (no start-up pricing), written after it and every minute while it serves (`specdec serve` "
        "gives one: a restart serves at once)",
    )


def model_service(args, role: str) -> int:
    limits = options.session_limits(args)  # checked before a model loads
    spec = options.model_spec(args)
    server_security = options.server_security(args)  # plaintext on a network address: refused first
    refuse_taken_ports(_own_ports(args))  # --port is bound once the model has loaded
    telemetry = _telemetry(args, role)  # first: a bad OTEL_* setting fails before the model loads
    for name, value in placement.SERVICE_ENV.items():  # read by OpenMP when torch loads it, just below
        os.environ.setdefault(name, value)
    from deploy import hosting  # torch and the model: only for the commands that host one

    cpus = None if args.cpus is None else parse_cpus(args.cpus)
    drafter, backend = getattr(args, "drafter", "auto"), getattr(args, "backend", "auto")
    config = ModelServiceConfig(role, spec, drafter, limits, cpus, args.threads, backend, compile=args.compile)
    server, port = hosting.start_model_service(config, args.host, args.port, server_security, telemetry)
    what = f"{role} service ({args.model})"
    address, reload = f"{args.host}:{port}", server_security.rotation.reload
    return serve_until_signal(server, address, args.ready_file, what, telemetry, args.drain_timeout, reload=reload)


def orchestrator(args) -> int:
    admission = options.admission_limits(args)
    server_security = options.server_security(args)  # plaintext on a network address: refused first
    client = options.service_client_security(args, server_security)
    refuse_taken_ports(_own_ports(args))  # --port and --http-port are bound once the pair is priced
    telemetry = _telemetry(args, "orchestrator")
    from deploy import hosting  # the orchestrator imports transformers for its tokenizer

    config = OrchestratorConfig(
        admission=admission,
        http_port=args.http_port,
        health_socket=args.health_socket,
        prices_file=args.prices_file,
        **options.request_defaults(args),
    )
    orchestrator = hosting.start_orchestrator(
        args.draft_address, args.target_address, config, args.host, args.port, server_security, client, telemetry
    )
    address = f"{args.host}:{orchestrator.port}"
    return serve_until_signal(
        orchestrator.server,
        address,
        args.ready_file,
        "orchestrator",
        telemetry,
        args.drain_timeout,
        orchestrator.http,
        server_security.rotation.reload,
    )


def serve(args) -> int:
    """The three services, supervised (deploy.local): one that dies is restarted on its ports;
    one that exits cleanly ends `serve` with exit code 1."""
    server_security = options.server_security(args)  # fails here, before any process starts
    # The orchestrator's ports are bound once both models have loaded: a second `serve` on them
    # is refused now, not a minute later.
    ports = _own_ports(args)
    if args.metrics_port:  # the model services' metrics, on loopback
        for whose in MODEL_SERVICES:
            offset = METRICS_OFFSETS[whose]
            what = f"--metrics-port {args.metrics_port} + {offset} (the {whose}'s)"
            ports.append((LOOPBACK, args.metrics_port + offset, what))
    refuse_taken_ports(ports)
    config = options.pipeline_config(
        args,
        host=args.host,
        port=args.port,
        tls=options.tls_files(args),
        auth_token=server_security.token,
        auth_token_file=args.auth_token_file,
        allow_insecure=args.allow_insecure,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        **options.request_defaults(args),
        session_limits=options.session_limits(args),
        admission=options.admission_limits(args),
        drain_timeout=args.drain_timeout,
        restart=RestartPolicy(unresponsive=args.health_timeout),
    )
    stop = stop_on_signal()
    with LocalPipeline(config, log=_log) as pipeline:
        http = {"http_url": pipeline.http_url} if pipeline.http_url else {}
        write_ready(args.ready_file, {"address": pipeline.address, "services": pipeline.addresses, **http})
        # SIGHUP: every child re-reads its TLS files, the orchestrator the clients' token file too
        # (specdec.serving.security.Rotation).
        signal.signal(signal.SIGHUP, lambda *_: pipeline.signal_all(signal.SIGHUP))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGHUP])
        logs = f"the services' logs in {pipeline.workdir}"
        _log(f"specdec: orchestrator ready at {pipeline.address} ({logs}; Ctrl-C to stop)")
        if pipeline.http_url:
            _log(f"specdec: OpenAI-compatible API at {pipeline.http_url}/v1, playground at {pipeline.http_url}/")
        while not stop.wait(0.5):  # wakes for signals as wait() does
            if pipeline.failure:
                _log(f"specdec: error: {pipeline.failure}; stopping the other services")
                return 1
        _log("specdec: stopping")
    return 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _own_ports(args) -> list[tuple[str, int | None, str]]:
    """The ports a server command binds on --host: (host, port, the flag and its value)."""
    flags = ("port", "http_port", "metrics_port")
    return [
        (args.host, getattr(args, f), f"--{f.replace('_', '-')} {getattr(args, f)}") for f in flags if hasattr(args, f)
    ]


def refuse_taken_ports(ports: list[tuple[str, int | None, str]]) -> None:
    """Before anything loads: ValueError naming the flag where two of a command's servers would bind
    one port, another process listens on one, or --host is no address of this machine (None: no such
    server; 0: a free port)."""
    named: dict[int, str] = {}
    for host, port, flag in ports:
        if port is None:
            continue
        if port and port in named:
            raise ValueError(f"{named[port]} and {flag} are one port: each server needs its own")
        named[port] = flag
        _refuse_unbindable(host, port, flag)


def _refuse_unbindable(host: str, port: int, flag: str) -> None:
    """ValueError where host:port cannot be bound: naming `flag` where another process listens on
    it, --host where it is no address here. A port held only by connections closing (TIME_WAIT) is
    free: the servers reuse it so."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as err:
        raise ValueError(f"--host {host}: no such host ({err.strerror or err})") from None
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ValueError(f"{flag}: another process listens on {host}:{port}") from None
            if err.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host {host}: not an address of this machine") from None


def _telemetry(args, role: str):
    from specdec.serving import telemetry  # the OpenTelemetry SDK: only for the commands that serve

    return telemetry.setup(role, args.metrics_port, args.host, environ=os.environ)


# -- signals and drain -------------------------------------------------------------------------
def stop_on_signal() -> threading.Event:
    """An event set by SIGTERM or SIGINT. The signals are unblocked in this (the main) thread:
    a parent may have started us with them blocked, and a blocked SIGTERM never arrives."""
    stop = threading.Event()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    return stop


def wait(stop: threading.Event) -> None:
    """Wait for `stop`, waking twice a second: Python runs a signal handler only when the main
    thread runs, and a signal the kernel hands to another thread does not wake a plain wait()."""
    while not stop.wait(0.5):
        pass


def serve_until_signal(
    server,
    address: str,
    ready_file: Path | None,
    what: str,
    telemetry=None,
    drain_timeout: float = 0.0,
    http=None,
    reload=None,
) -> int:
    """Serve until SIGTERM or SIGINT, then drain (health NOT_SERVING, new work refused,
    in-flight work finished within drain_timeout) and stop; exit code 0. `http`: the HTTP
    front door (orchestrator.openai_api), stopped after the drain and the gRPC server's stop. SIGHUP calls `reload()`
    (re-read the TLS files and the token: specdec.serving.security.Rotation)."""
    stop = stop_on_signal()
    if reload is not None:
        signal.signal(signal.SIGHUP, lambda *_: reload())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGHUP])
    ready = {"address": address}
    if http is not None:
        ready["http_url"] = http.url
        _log(f"specdec: OpenAI-compatible API at {http.url}/v1, playground at {http.url}/")
    if telemetry is not None and telemetry.metrics_address:
        ready["metrics_address"] = telemetry.metrics_address
        _log(f"specdec: {what} metrics on http://{telemetry.metrics_address}/metrics")
    from specdec.serving import lifecycle  # loaded by now: the server's

    lifecycle.freeze_heap()
    write_ready(ready_file, ready)
    _log(f"specdec: {what} serving on {address}")
    wait(stop)
    _log(f"specdec: {what} draining (up to {drain_timeout:g} s)")
    if not server.drain(drain_timeout):
        _log(f"specdec: {what}: drain timed out; stopping with work in flight")
    # gRPC first: the calls still running end (UNAVAILABLE), so the HTTP front door's requests riding
    # on them answer 503 or end their streams with an error event; stopped first, the front door
    # waited on them, cut them without a word, and the orchestrator was killed past its stop timeout.
    stopped = server.stop(grace=1)
    if http is not None:
        http.stop()
    stopped.wait()
    if telemetry is not None:
        telemetry.shutdown()  # flushes the last spans and metrics
    return 0


def write_ready(ready_file: Path | None, info: dict) -> None:
    """Write `info` as JSON to `ready_file` at once (a rename): a reader never sees half of it."""
    if ready_file:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.rename(ready_file)


COMMANDS = {
    "serve": serve,
    "draft-service": lambda a: model_service(a, "draft"),
    "target-service": lambda a: model_service(a, "target"),
    "orchestrator": orchestrator,
}
