"""The option groups the commands share, defined once, and the settings built from them.

Models, drafters, servers, limits, telemetry and TLS / token flags; then the frozen
configs those flags become (specdec.serving.security, specdec.limits, deploy.local, deploy.hosting).
Tokens are read here from their files or from $SPECDEC_AUTH_TOKEN / $SPECDEC_SERVICE_AUTH_TOKEN; the
settings the library takes from the environment ($SPECDEC_CACHE, $SPECDEC_FUSE) by apply_environment, once
a process (cli.main), and the OTEL_* variables by the commands that serve (cli.serving).
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path

from deploy import liveness
from deploy.configs import BACKENDS, OrchestratorConfig
from deploy.local import METRICS_OFFSETS, PipelineConfig, Placement
from draft_service import METHODS as DRAFTERS
from orchestrator import CALIBRATION_TOKENS, RULES
from specdec import validation
from specdec.limits import DRAIN_TIMEOUT, AdmissionLimits, SessionLimits
from specdec.runtime.placement import parse_cpus
from specdec.serving import security
from specdec.weights import embedded, models

FUSE_ENV = "SPECDEC_FUSE"  # specdec.runtime.graphs.FUSE_ENV, not imported here: specdec.runtime.graphs imports torch


def apply_environment(environ: Mapping[str, str] | None = None) -> None:
    """Set the library's settings from the environment (os.environ where None), once a process, before a
    command runs: the cache ($SPECDEC_CACHE; specdec.weights.embedded.set_cache_dir) and the fusion of CUDA models
    ($SPECDEC_FUSE; specdec.runtime.graphs.set_fuse, imported only where the variable is set or torch is loaded
    already, so that a client's command imports no torch). The children a command starts (deploy.local)
    inherit the environment and read it again as they start."""
    environ = os.environ if environ is None else environ
    embedded.set_cache_dir(environ.get(embedded.CACHE_ENV))
    fuse = environ.get(FUSE_ENV)
    if fuse or "specdec.runtime.graphs" in sys.modules:
        from specdec.runtime import graphs

        graphs.set_fuse(fuse)


def add_model_flags(p: argparse.ArgumentParser, dtype: str, prefix: str = "") -> None:
    p.add_argument(
        f"--{prefix}model",
        default=models.DEFAULT_ALIAS,
        help=f"hub id, local path, or '{models.DEFAULT_ALIAS}' (the embedded default; default); as a target, "
        f"{', '.join(repr(a) for a in models.GROWN_ALIASES)}: the embedded model grown deeper (x4, x8) or "
        "wider too (w4: ~1.9B, w4x4: ~7B parameters), the same logits at the cost of a larger model; as a draft, "
        f"{' or '.join(repr(a) for a in models.ROUNDED_ALIASES)}: its weights rounded to 4 / 3 bits, a weaker draft "
        "where draft trees pay (each built once; transformers only)",
    )
    p.add_argument(f"--{prefix}device", default="cpu", help="torch device: cpu or cuda:N (default cpu)")
    p.add_argument(f"--{prefix}dtype", default=dtype, choices=models.DTYPES, help=f"weight dtype (default {dtype})")


def add_pair_flags(p: argparse.ArgumentParser) -> None:
    """The target and draft models of a local pipeline, their cores and threads, the target's
    backend and the drafter."""
    add_model_flags(p, models.DEFAULT_TARGET_DTYPE, "target-")
    add_backend_flag(p, "target-")
    add_model_flags(p, models.DEFAULT_DRAFT_DTYPE, "draft-")
    add_placement_flags(p, "target-")
    add_placement_flags(p, "draft-")
    add_drafter_flag(p)
    add_compile_flag(p, "target-")


def add_placement_flags(p: argparse.ArgumentParser, prefix: str = "") -> None:
    who = f"the {prefix[:-1]} service" if prefix else "the service"
    p.add_argument(
        f"--{prefix}cpus",
        metavar="LIST",
        help=f"CPU cores {who} may use, as taskset lists them (0 or 0,2 or 0-3): pinned, a service owns its "
        "cores and runs every forward on its own threads (default: all it was started with, shared with the other "
        "service as the orchestrator chooses round by round)",
    )
    p.add_argument(
        f"--{prefix}threads",
        type=int,
        metavar="N",
        help=f"threads of {who}'s forwards at most (default: one per core)",
    )


def add_compile_flag(p: argparse.ArgumentParser, prefix: str = "") -> None:
    who = f"the {prefix[:-1]} service's" if prefix else "the"
    p.add_argument(
        f"--{prefix}compile",
        action=argparse.BooleanOptionalAction,
        help=f"run {who} transformers model's decode and verify forwards as CUDA graphs, captured at start "
        "(seconds) for every batch, width and KV-length bucket, over a KV cache allocated once: --max-sessions "
        "slots of --max-kv-tokens / --max-sessions positions each, the service's context. CUDA only; default: "
        "on for a CUDA device (a CPU serves eager; specdec/runtime/graphs.py says why)",
    )


def add_backend_flag(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """What runs the target model (deploy.configs.ModelServiceConfig.backend)."""
    model = f"--{prefix}model" if prefix else "--model"
    p.add_argument(
        f"--{prefix}backend",
        default="auto",
        choices=BACKENDS,
        help="what runs the target model. auto (default): llamacpp for the embedded default in float32 on a CPU "
        "where llama-cpp-python is installed (its F32 GGUF holds the same weights, and llama.cpp decodes them ~3x "
        "faster than transformers there; draft trees are verified chain by chain; its sessions at most "
        "--max-sessions, --max-kv-tokens / 4096 and 256: 16 at the defaults, which admission follows) and for a "
        ".gguf file; torch for anything else (another model or dtype, a CUDA device, the grown and rounded "
        "aliases). torch: transformers with --dtype and --device. llamacpp: llama.cpp on a GGUF file, in the "
        "file's own type, not --dtype (needs llama-cpp-python): "
        f"'{models.DEFAULT_ALIAS}' runs the embedded GGUF requantised to F32 once (the same weights as the fp32 "
        f"torch target; cached beside the fp32 conversion). A {model} ending in .gguf implies llamacpp",
    )


def add_drafter_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        default="auto",
        choices=DRAFTERS,
        help="auto (default): hybrid. hybrid: suffix's proposal where its match is strong (text that copies), "
        "else the draft model's, run by llama.cpp for the embedded default draft when llama-cpp-python is "
        "installed (its GGUF requantised to Q8_0: the draft that pays on a CPU) and for a .gguf draft, else by "
        "transformers; llamacpp: that GGUF run by llama.cpp alone (needs llama-cpp-python); model: a "
        "transformers draft model alone; ngram: model-free prompt lookup over the session's tokens (the draft "
        "model only gives the tokenizer); suffix: model-free, the continuation most frequent after the longest "
        "match in the session and in this client's recent requests",
    )


def add_lookahead_flag(p: argparse.ArgumentParser, client: bool = True) -> None:
    """A client's --lookahead (default None: only what the user gives is sent; the orchestrator applies
    its default), or a server's --lookahead and --adaptive, the defaults of requests that do not say."""
    d, most, measured = validation.DEFAULT_LOOKAHEAD, validation.MAX_LOOKAHEAD, validation.MEASURED_LOOKAHEAD
    if client:
        p.add_argument(
            "--lookahead",
            type=int,
            help=f"draft tokens per round, 1..{most} (default: the server's: unless it was started with "
            f"--lookahead, a greedy chain gets the k its pair's measured costs price fastest, else {d})",
        )
        return
    p.add_argument(
        "--lookahead",
        type=int,
        help=f"draft tokens per round (with --adaptive: the most) for requests that do not say "
        f"(speculation.lookahead), 1..{most} (default: measured: a greedy or invariant-rule chain runs at the k "
        f"in 1..{measured} that the pair's measured costs and acceptance price fastest, once measured; "
        f"{d} before that, for a Leviathan sample, for trees and as adaptive's most)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=CALIBRATION_TOKENS,
        metavar="N",
        help=f"greedy tokens the orchestrator generates at start, on built-in prompts, to measure the pair's "
        f"acceptance and costs before it serves, so the first request that names no lookahead runs the k a warm "
        f"server would, then times that k against plain rounds on the same prompts: where speculation timed "
        f"slower, a request alone that names no lookahead runs plain rounds (0: none; it then runs {d} until "
        "requests measure the pair; default: %(default)s; 3-6 s on the default pair on two CPU cores, "
        "whose hybrid drafter is priced, not timed)",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="adaptive lookahead for requests that do not say (speculation.adaptive): k chosen each round in "
        "1..--lookahead from the acceptance and costs measured (default: off). On one GPU, --adaptive --lookahead "
        "16 ran within 5%% of the best fixed k one request at a time, 1.46x k = 4 on an 8B-like target (docs/gpu.md)",
    )


def request_defaults(args) -> dict:
    """A server's flags for what requests leave unset: PipelineConfig's and OrchestratorConfig's fields,
    checked here (ValueError), before any process starts."""
    defaults = dict(
        overlap=args.overlap,
        speculation_cache=not args.no_speculation_cache,
        rule=args.rule,
        tree_nodes=args.tree,
        lookahead=args.lookahead,
        adaptive=args.adaptive,
        calibration_tokens=args.calibration_tokens,
    )
    OrchestratorConfig(**defaults)
    return defaults


def given(**fields) -> dict:
    """The flags the user gave: a field left unset takes the server's default."""
    return {name: value for name, value in fields.items() if value is not None}


def add_limit_flags(p: argparse.ArgumentParser, role: str) -> None:
    """Limits and shutdown: a model service's session caps ("model"), the orchestrator's
    admission ("orchestrator"), both and the drain ("serve", which starts all three), or both
    without the drain ("all": `ray up`, whose actors stop as Ray stops them)."""
    a, s = AdmissionLimits(), SessionLimits()
    concurrent = a.max_concurrent if role == "orchestrator" else None  # None: --max-sessions (admission_limits)
    orchestrator = [
        ("--max-concurrent", positive, concurrent, "generations running at once"),
        ("--max-queue", non_negative, a.max_queue, "requests waiting for a slot; beyond it RESOURCE_EXHAUSTED"),
    ]
    model = [
        ("--max-sessions", positive, s.max_sessions, "sessions open at once"),
        ("--max-kv-tokens", non_negative, s.max_kv_tokens, "KV-cache tokens held across sessions; 0: no cap"),
        ("--session-ttl", seconds, s.idle_ttl, "close sessions idle this many seconds; 0: never"),
    ]
    flags = {"orchestrator": orchestrator, "model": model, "all": orchestrator + model}[
        role if role != "serve" else "all"
    ]
    if role != "all":
        flags.append(("--drain-timeout", seconds, DRAIN_TIMEOUT, "on SIGTERM, seconds to let in-flight work finish"))
    for flag, kind, default, text in flags:
        shown = "--max-sessions: a session on each service a generation" if default is None else f"{default:g}"
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {shown})")
    if role != "orchestrator":
        add_prefix_cache_flag(p)


def add_prefix_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="the model services prefill every prompt whole (default: a prompt that begins with tokens another "
        "session computed, open or recently closed, reuses their keys and values: a system prompt, the next turn "
        "of a conversation; closed sessions' caches are kept within --max-kv-tokens)",
    )


def port_number(text: str) -> int:
    """A port flag's value, 0 (a free one) to 65535; argparse names the flag where it is not."""
    port = int(text)  # not a number: argparse's "invalid port_number value"
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: a free one), not {port}")
    return port


def whole(least: int, name: str):
    """A count flag's argparse type: a whole number >= `least` (`name`: argparse's "invalid NAME value")."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, not {value}")
        return value

    parse.__name__ = name
    return parse


def finite(least: float, unit: str, name: str, strict: bool = False):
    """A flag's argparse type: a finite number of `unit`s >= `least` (> where `strict`)."""

    def parse(text: str) -> float:
        value = float(text)
        if not (math.isfinite(value) and (value > least if strict else value >= least)):
            raise argparse.ArgumentTypeError(f"{unit} {'>' if strict else '>='} {least:g}, not {text}")
        return value

    parse.__name__ = name
    return parse


positive = whole(1, "positive")  # a count (0 started the services and ran nothing, or every request refused)
non_negative = whole(0, "non_negative")  # a count where 0 is one (none queued, no cap)
seconds = finite(0, "seconds", "seconds")  # a duration (--drain-timeout -1 started the services and drained nothing)
# a duration where 0 makes no sense (a run's whole time: loadtest --time-limit, chaos --duration)
positive_seconds = finite(0, "seconds", "positive_seconds", strict=True)


def add_health_timeout_flag(p: argparse.ArgumentParser, what: str) -> None:
    """--health-timeout: how long `what` may answer nothing (stopped, deadlocked) before it is killed
    and restarted (deploy.liveness)."""
    p.add_argument(
        "--health-timeout",
        type=seconds,
        default=liveness.UNRESPONSIVE_SECONDS,
        help=f"seconds {what} may answer no health check (a hung host) before it is killed and restarted; "
        f"0: never (default {liveness.UNRESPONSIVE_SECONDS:g})",
    )


def host_port(text: str) -> str:
    """An address flag's value: HOST:PORT (a gRPC target; without a port gRPC would dial 443)."""
    if ":" not in text:
        raise argparse.ArgumentTypeError(f"an address is HOST:PORT (e.g. 127.0.0.1:50051), not {text!r}")
    port = text.rpartition(":")[2]
    if port.isdigit() and not 0 < int(port) < 65536:  # gRPC dialed it and said "Connection refused"
        raise argparse.ArgumentTypeError(f"a port is 1..65535, not {port} in {text!r}")
    return text


def add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=port, help=f"port to bind; 0 picks a free one (default {port})")
    p.add_argument(
        "--ready-file", type=Path, help='write {"address": ...} here once serving (removed at start and at stop)'
    )
    add_metrics_flag(p, "serve Prometheus metrics on this port at /metrics (0 picks a free one; default: off)")


def metrics_base_port(text: str) -> int:
    """`serve`'s --metrics-port: the orchestrator's, the target's +1 and the draft's +2, each a port."""
    port, top = port_number(text), max(METRICS_OFFSETS.values())
    if port > 65535 - top:
        raise argparse.ArgumentTypeError(
            f"the draft's metrics take this port + {top}, so at most {65535 - top}, not {port}"
        )
    return port


def add_metrics_flag(p: argparse.ArgumentParser, text: str, type=port_number) -> None:
    p.add_argument("--metrics-port", type=type, default=None, help=text + "; traces: see OTEL_* in the README")


def add_http_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        help="also serve the OpenAI-compatible HTTP API and the playground on --host at this port; 0 picks a "
        "free one (default: off). Same token and certificate as gRPC",
    )


def add_rule_flag(p: argparse.ArgumentParser, client: bool = False) -> None:
    whose = "this request" if client else "requests that do not say (speculation.rule)"
    p.add_argument(
        "--rule",
        choices=RULES,
        default=None if client else RULES[0],
        help=f"the sampling rule of {whose}, both exact: leviathan (accept with min(1, p/q), resample the "
        "residual; a seed reproduces the text for a fixed --lookahead) or invariant (Gumbel-max coupling: a "
        "seed gives the target's own sample, the same text with or without speculation, for any lookahead, "
        "drafter, overlap or load; a little lower acceptance). Greedy decoding is the same under both "
        + (
            "(default: the server's, leviathan unless it was started with --rule)"
            if client
            else "(default %(default)s)"
        ),
    )


def add_tree_flag(p: argparse.ArgumentParser, client: bool = False) -> None:
    whose = "this request" if client else "requests that do not say (speculation.tree_nodes)"
    p.add_argument(
        "--tree",
        type=int,
        metavar="NODES",
        default=None if client else 0,
        help=f"draft trees for {whose}: each round the draft proposes up to NODES tokens (0.."
        f"{validation.MAX_TREE_NODES}; 0: chains), a spine of --lookahead steps and its most probable runners-up, and "
        "the target verifies them (a transformers target in one forward, a llama.cpp one chain by chain, only the "
        "chains the rule walks into); sequential rounds "
        + ("(default: the server's, chains unless it was started with --tree)" if client else "(default 0: chains)"),
    )


def add_overlap_flag(p: argparse.ArgumentParser, client: bool = False) -> None:
    whose = "this request" if client else "requests that do not say (speculation.overlap)"
    default = "the server's" if client else "overlapped, except where the two services share one GPU"
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"overlapped rounds for {whose}: the draft proposes the next round while the target verifies; "
        f"--no-overlap: sequential rounds, the draft waits (default: {default}, where overlapped kernels "
        "time-slice the device and lose; output unchanged either way)",
    )
    whose = "this request" if client else "requests that do not say (speculation.cache)"
    p.add_argument(
        "--no-speculation-cache",
        action="store_true",
        help=f"no speculation cache for {whose}: in overlapped rounds (greedy, the invariant rule) the draft "
        "also prepares the next round for the likeliest rejections while the target verifies (default: "
        + ("the server's, on unless it was started with --no-speculation-cache" if client else "on")
        + "; output unchanged)",
    )


def add_server_security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS and authentication (server)")
    g.add_argument("--tls-cert", type=Path, metavar="FILE", help="PEM certificate (chain) to serve TLS with")
    g.add_argument("--tls-key", type=Path, metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca", type=Path, metavar="FILE", help="PEM CA; require client certificates it signed (mTLS)"
    )
    g.add_argument(
        "--auth-token-file",
        type=Path,
        metavar="FILE",
        help=f"require 'authorization: Bearer <token>' on every call; token in FILE (default: ${security.TOKEN_ENV})",
    )
    g.add_argument("--allow-insecure", action="store_true", help="allow plaintext gRPC with non-loopback addresses")


def add_client_security_flags(
    p: argparse.ArgumentParser, prefix: str = "", peer: str = "the orchestrator", starts_services: bool = False
) -> None:
    """The TLS and token flags of a client of `peer` (`prefix` "service-": the orchestrator's of the model
    services; `starts_services`: the command starts them, with a token of their own: service_client_security)."""
    g = p.add_argument_group(f"TLS and authentication (client of {peer})")
    g.add_argument(f"--{prefix}tls", action="store_true", help=f"connect to {peer} over TLS, system root CAs")
    g.add_argument(
        f"--{prefix}tls-ca", type=Path, metavar="FILE", help="PEM CA that signed the server's certificate (TLS)"
    )
    g.add_argument(f"--{prefix}tls-cert", type=Path, metavar="FILE", help="PEM client certificate, for mutual TLS")
    g.add_argument(f"--{prefix}tls-key", type=Path, metavar="FILE", help="PEM private key of the client certificate")
    g.add_argument(f"--{prefix}tls-server-name", metavar="NAME", help="name to verify in the server's certificate")
    own = "one made for the services alone" if starts_services else "the orchestrator's own"
    default = f"${security.SERVICE_TOKEN_ENV}, else {own}" if prefix else f"${security.TOKEN_ENV}"
    g.add_argument(
        f"--{prefix}auth-token-file",
        type=Path,
        metavar="FILE",
        help=f"send the bearer token read from FILE (default: {default})",
    )
    if not prefix:  # a server's --allow-insecure covers its own client links too
        g.add_argument("--allow-insecure", action="store_true", help="allow plaintext gRPC to a non-loopback --address")


# -- settings from the flags -------------------------------------------------------------------
def model_spec(args, prefix: str = "") -> models.ModelSpec:
    def arg(name):
        return getattr(args, prefix.replace("-", "_") + name)

    return models.ModelSpec(arg("model"), arg("device"), arg("dtype"))


def session_limits(args) -> SessionLimits:
    return SessionLimits(args.max_sessions, args.max_kv_tokens, args.session_ttl, prefix_cache=not args.no_prefix_cache)


def admission_limits(args) -> AdmissionLimits:
    """The orchestrator's admission; where the same command sets the services' sessions (`serve`,
    `ray up`), generations at once follow --max-sessions unless --max-concurrent says otherwise."""
    concurrent = args.max_concurrent if args.max_concurrent is not None else getattr(args, "max_sessions", None)
    return AdmissionLimits(AdmissionLimits().max_concurrent if concurrent is None else concurrent, args.max_queue)


def pipeline_config(args, **kw) -> PipelineConfig:
    """The local pipeline of the pair flags; a command without the limit flags may still have
    --no-prefix-cache (generate)."""
    if "session_limits" not in kw:
        kw["session_limits"] = SessionLimits(prefix_cache=not getattr(args, "no_prefix_cache", False))
    return PipelineConfig(
        target=model_spec(args, "target-"),
        draft=model_spec(args, "draft-"),
        drafter=args.drafter,
        target_backend=args.target_backend,
        draft_placement=placement(args, "draft-"),
        target_placement=placement(args, "target-"),
        target_compile=args.target_compile,
        **kw,
    )


def placement(args, prefix: str = "") -> Placement:
    """A service's cores and threads as flags name them; the list is checked here, applied by the service."""
    cpus, threads = (getattr(args, prefix.replace("-", "_") + name) for name in ("cpus", "threads"))
    if cpus is not None:
        parse_cpus(cpus)
    if threads is not None and threads < 1:  # 0 would be no flag at all: the service's default
        raise ValueError(f"--{prefix}threads must be >= 1, got {threads}")
    return Placement(cpus, threads)


def tls_files(args) -> security.ServerTLSFiles:
    return security.ServerTLSFiles(args.tls_cert, args.tls_key, args.tls_client_ca)


def server_security(args, check_host: bool = True, reloadable: bool = True) -> security.ServerSecurity:
    """The server's TLS files and token, checked now: a bad setting fails before a model loads.
    Reloadable: read again on each rotation.reload() (SIGHUP); Ray actors get a fixed copy."""

    def load():
        token = security.read_token(args.auth_token_file, os.environ.get(security.TOKEN_ENV))
        return tls_files(args).load(token, args.allow_insecure)

    settings = security.reloadable(load) if reloadable else load()
    if check_host:
        security.check_bind(args.host, settings)
    return settings


def client_security(
    args, prefix: str = "", token_env: str = security.TOKEN_ENV, default_token: str | None = None
) -> security.ClientSecurity:
    def arg(name):
        return getattr(args, prefix.replace("-", "_") + name)

    return security.ClientSecurity(
        tls=arg("tls"),
        root_ca=security.read_pem(arg("tls_ca")),
        cert_chain=security.read_pem(arg("tls_cert")),
        private_key=security.read_pem(arg("tls_key")),
        server_name=arg("tls_server_name"),
        token=security.read_token(arg("auth_token_file"), os.environ.get(token_env)) or default_token,
        allow_insecure=args.allow_insecure,
    )


def service_client_security(
    args, server: security.ServerSecurity, starts_services: bool = False
) -> security.ClientSecurity:
    """How the orchestrator reaches the model services: the --service-* flags. By default its own
    token; where the services are started with it (`starts_services`: ray up), a token made for
    them alone, so that a client's token opens nothing on them (least privilege)."""
    default = secrets.token_urlsafe(32) if starts_services else server.token
    return client_security(args, "service-", security.SERVICE_TOKEN_ENV, default)


def local_pipeline_group(parser: argparse.ArgumentParser, command: str):
    """The argument group of the flags that configure the local pipeline `command` starts without
    --address (refuse_local_flags refuses them with it)."""
    local = parser.add_argument_group(
        "local pipeline (without --address)", f"the processes {command} starts; refused with --address"
    )
    parser.set_defaults(parser=parser, local_flags=local._group_actions)  # argparse lists a group's flags nowhere else
    return local


def refuse_local_flags(args) -> None:
    """A usage error (exit 2) naming the local pipeline's flags given with --address: the orchestrator
    there serves its own models and settings, so they would be ignored. Given: set to other than the default."""
    given = []
    for action in args.local_flags:
        value = getattr(args, action.dest)
        if value != action.default:  # --no-target-compile: the second of its two
            given.append(action.option_strings[value is False and len(action.option_strings) > 1])
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        args.parser.error(
            f"{', '.join(given)} {verb} to a local pipeline only, not with --address "
            "(the orchestrator there runs its own models and settings)"
        )
