"""The `specdec` command line. argv and the environment are read here and nowhere else.

The client path (`generate --address`) imports only grpc and the stubs; torch and
transformers are imported by the commands that host a model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

import grpc

from deploy import ray_cli
from specdec import models, security
from specdec.errors import SpecdecError

EPILOG = """\
examples:
  specdec generate "Write a haiku about GPUs"          # local draft+target+orchestrator, default pair
  specdec generate "Hi" --json --max-tokens 32         # one JSON object with text and stats
  specdec serve --port 50051                           # the three services, until Ctrl-C
  specdec generate "Hi" --address 127.0.0.1:50051      # use a running orchestrator
  specdec target-service --host 0.0.0.0 --port 50061 --tls-cert b.pem --tls-key b.key   # one service per host
  specdec draft-service --host 0.0.0.0 --port 50062 --tls-cert a.pem --tls-key a.key
  specdec orchestrator --port 50051 --draft-address hostA:50062 --target-address hostB:50061 --service-tls-ca ca.pem
  specdec loadtest --address 127.0.0.1:50051 --requests 64 --concurrency 16 --time-limit 300
  specdec ray up --draft-gpus 1 --target-gpus 1        # as Ray actors (see specdec ray up --help)

TLS, mutual TLS and bearer tokens: every server takes --tls-cert/--tls-key (TLS),
--tls-client-ca (mTLS) and --auth-token-file (or $SPECDEC_AUTH_TOKEN); clients take
--tls-ca, --tls-cert/--tls-key and --auth-token-file. Plaintext only on loopback unless
--allow-insecure.
"""


def _add_model_flags(p: argparse.ArgumentParser, dtype: str, prefix: str = "") -> None:
    p.add_argument(
        f"--{prefix}model",
        default=models.DEFAULT_ALIAS,
        help=f"hub id, local path, or '{models.DEFAULT_ALIAS}' (the embedded default; default)",
    )
    p.add_argument(f"--{prefix}device", default="cpu", help="torch device: cpu or cuda:N (default cpu)")
    p.add_argument(f"--{prefix}dtype", default=dtype, choices=models.DTYPES, help=f"weight dtype (default {dtype})")


def _add_reliability_flags(p: argparse.ArgumentParser, role: str) -> None:
    """Limits and shutdown: a model service's session caps, the orchestrator's admission."""
    from specdec.limits import DRAIN_TIMEOUT, AdmissionLimits, SessionLimits

    a, s = AdmissionLimits(), SessionLimits()
    flags = {
        "orchestrator": [
            ("--max-concurrent", int, a.max_concurrent, "generations running at once"),
            ("--max-queue", int, a.max_queue, "requests waiting for a slot; beyond it RESOURCE_EXHAUSTED"),
        ],
        "model": [
            ("--threads", int, len(os.sched_getaffinity(0)), "torch (and llama.cpp) threads: the model worker's"),
            ("--max-sessions", int, s.max_sessions, "sessions open at once"),
            ("--max-kv-tokens", int, s.max_kv_tokens, "KV-cache tokens held across sessions; 0: no cap"),
            ("--session-ttl", float, s.idle_ttl, "close sessions idle this many seconds; 0: never"),
        ],
    }["orchestrator" if role == "orchestrator" else "model"]
    flags.append(("--drain-timeout", float, DRAIN_TIMEOUT, "on SIGTERM, seconds to let in-flight work finish"))
    for flag, kind, default, text in flags:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default:g})")


def _add_drafter_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        default="model",
        choices=("model", "ngram", "llamacpp"),
        help="model: a transformers draft model (default); ngram: model-free prompt lookup over the "
        "session's tokens (the draft model only gives the tokenizer); llamacpp: a GGUF run by llama.cpp "
        "(needs llama-cpp-python; the default alias runs the embedded Q4_1 GGUF)",
    )


def _add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help=f"port to bind; 0 picks a free one (default {port})")
    p.add_argument("--ready-file", type=Path, help='write {"address": ...} here once serving')
    _add_metrics_flag(p, "serve Prometheus metrics on this port at /metrics (0 picks a free one; default: off)")


def _add_metrics_flag(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--metrics-port", type=int, default=None, help=text + "; traces: see OTEL_* in the README")


def _add_server_security_flags(p: argparse.ArgumentParser) -> None:
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


def _add_client_security_flags(p: argparse.ArgumentParser, prefix: str = "", peer: str = "the orchestrator") -> None:
    g = p.add_argument_group(f"TLS and authentication (client of {peer})")
    g.add_argument(f"--{prefix}tls", action="store_true", help=f"connect to {peer} over TLS, system root CAs")
    g.add_argument(
        f"--{prefix}tls-ca", type=Path, metavar="FILE", help="PEM CA that signed the server's certificate (TLS)"
    )
    g.add_argument(f"--{prefix}tls-cert", type=Path, metavar="FILE", help="PEM client certificate, for mutual TLS")
    g.add_argument(f"--{prefix}tls-key", type=Path, metavar="FILE", help="PEM private key of the client certificate")
    g.add_argument(f"--{prefix}tls-server-name", metavar="NAME", help="name to verify in the server's certificate")
    default = f"${security.SERVICE_TOKEN_ENV}, else the orchestrator's own" if prefix else f"${security.TOKEN_ENV}"
    g.add_argument(
        f"--{prefix}auth-token-file",
        type=Path,
        metavar="FILE",
        help=f"send the bearer token read from FILE (default: {default})",
    )
    if not prefix:  # a server's --allow-insecure covers its own client links too
        g.add_argument("--allow-insecure", action="store_true", help="allow plaintext gRPC to a non-loopback --address")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Distributed speculative decoding: a draft model proposes, a target model "
        "verifies, and the output is distributed exactly as the target alone would sample it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate",
        help="generate text (starts local services unless --address is given)",
        description="Generate a continuation of PROMPT. Without --address, starts the draft, "
        "target and orchestrator as three local processes, generates, and stops them.",
    )
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--address", help="HOST:PORT of a running orchestrator")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    g.add_argument("--seed", type=int, default=0, help="seed for sampling (default 0: random)")
    g.add_argument("--lookahead", type=int, default=4, help="draft tokens per round, 1..32 (default 4)")
    g.add_argument("--no-speculation", action="store_true", help="target-only decoding through the target service")
    g.add_argument("--adaptive", action="store_true", help="choose k per round in 1..--lookahead from acceptance")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    g.add_argument("--timeout", type=float, default=None, help="deadline for the request in seconds")
    _add_model_flags(g, models.DEFAULT_TARGET_DTYPE, "target-")
    _add_model_flags(g, models.DEFAULT_DRAFT_DTYPE, "draft-")
    _add_drafter_flag(g)
    _add_client_security_flags(g)

    s = sub.add_parser("serve", help="run draft, target and orchestrator locally until interrupted")
    s.add_argument("--host", default="127.0.0.1", help="orchestrator address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="orchestrator port (default 50051)")
    _add_metrics_flag(s, "Prometheus metrics: orchestrator on this port, target +1, draft +2 (default: off)")
    _add_model_flags(s, models.DEFAULT_TARGET_DTYPE, "target-")
    _add_model_flags(s, models.DEFAULT_DRAFT_DTYPE, "draft-")
    _add_drafter_flag(s)
    _add_server_security_flags(s)

    d = sub.add_parser("draft-service", help="run the draft model service alone")
    _add_server_flags(d, 50062)
    _add_model_flags(d, models.DEFAULT_DRAFT_DTYPE)
    _add_drafter_flag(d)
    _add_server_security_flags(d)
    _add_reliability_flags(d, "draft")
    t = sub.add_parser("target-service", help="run the target model service alone")
    _add_server_flags(t, 50061)
    _add_model_flags(t, models.DEFAULT_TARGET_DTYPE)
    _add_server_security_flags(t)
    _add_reliability_flags(t, "target")

    b = sub.add_parser(
        "bench",
        help="benchmark specdec against target-only and assisted generation",
        description="Side by side on bench/prompts.json: (a) transformers target-only generate, (b) transformers "
        "assisted generation with the same draft, (c) specdec with speculation off, (d) specdec with fixed and "
        "adaptive lookahead, per drafter. Prints a table, writes results.json and speedup.png.",
    )
    b.add_argument(
        "--quick", action="store_true", help="a small run: first 2 prompts (of --kinds), 32 tokens, greedy, k in {2, 4}"
    )
    b.add_argument("--drafters", default="model,ngram,llamacpp", help="comma list of model, ngram, llamacpp")
    b.add_argument("--ks", default="2,4,8", help="fixed lookaheads to run (default 2,4,8)")
    b.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-lookahead rows")
    b.add_argument("--temperatures", default="0,0.7", help="comma list (default 0,0.7)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per generation (default 128)")
    b.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (default 1)")
    b.add_argument("--kinds", default="", help="only prompts of these kinds: chat, code, summarisation, list")
    b.add_argument("--no-hf", action="store_true", help="skip the in-process transformers baselines")
    b.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default bench-results)")
    b.add_argument(
        "--concurrency",
        default="",
        help="comma list of concurrent clients (e.g. 1,2,4,8): the concurrency benchmark (bench/concurrency.py) "
        "instead, for speculation off, --ks and adaptive, per drafter (default there: llamacpp, k 4, 48 tokens)",
    )
    b.add_argument("--prompts", type=int, default=4, help="with --concurrency: prompts cycled (default 4)")
    _add_model_flags(b, models.DEFAULT_TARGET_DTYPE, "target-")
    _add_model_flags(b, models.DEFAULT_DRAFT_DTYPE, "draft-")

    o = sub.add_parser("orchestrator", help="run the orchestrator alone, against running services")
    _add_server_flags(o, 50051)
    o.add_argument("--target-address", required=True, help="HOST:PORT of the target service")
    o.add_argument("--draft-address", help="HOST:PORT of the draft service (omit: target-only)")
    _add_server_security_flags(o)
    _add_client_security_flags(o, "service-", "the model services")
    _add_reliability_flags(o, "orchestrator")

    lt = sub.add_parser(
        "loadtest",
        help="a bounded load test: N requests, C at a time, within a time limit",
        description="Send --requests Generate calls, --concurrency at a time, all ending by --time-limit; "
        "report throughput, p50/p99 latency and errors. Loopback targets only unless --allow-remote. "
        "Without --address, starts the three local processes first (not timed).",
    )
    lt.add_argument("--address", help="HOST:PORT of a running orchestrator")
    lt.add_argument("--requests", type=int, default=32, help="requests in all (default 32)")
    lt.add_argument("--concurrency", type=int, default=4, help="concurrent clients (default 4)")
    lt.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole run (default 300)")
    lt.add_argument(
        "--prompt", default="Explain speculative decoding in three sentences.", help="prompt of every request"
    )
    lt.add_argument("--max-tokens", type=int, default=64, help="tokens per request at most (default 64)")
    lt.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    lt.add_argument("--lookahead", type=int, default=4, help="draft tokens per round (default 4)")
    lt.add_argument("--json", action="store_true", help="print one JSON object")
    lt.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --address")
    _add_model_flags(lt, models.DEFAULT_TARGET_DTYPE, "target-")
    _add_model_flags(lt, models.DEFAULT_DRAFT_DTYPE, "draft-")
    _add_drafter_flag(lt)
    _add_client_security_flags(lt)

    ray_up = ray_cli.add_parser(sub)
    _add_drafter_flag(ray_up)
    _add_server_security_flags(ray_up)
    _add_client_security_flags(ray_up, "service-", "the model services")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except grpc.RpcError as err:
        print(f"specdec: error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except SpecdecError as err:
        print(f"specdec: error: {err.code.name}: {err.message}", file=sys.stderr)
        return 1
    except (RuntimeError, OSError, ValueError) as err:
        print(f"specdec: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# -- client ------------------------------------------------------------------------------
def _request(args):
    from specdec.v1 import model_pb2, orchestrator_pb2

    return orchestrator_pb2.GenerateRequest(
        prompt=args.prompt,
        chat_template=not args.raw,
        sampling=model_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
        seed=args.seed,
        max_new_tokens=args.max_tokens,
        stop_strings=args.stop,
        speculation=orchestrator_pb2.SpeculationParams(
            lookahead=args.lookahead, disabled=args.no_speculation, adaptive=args.adaptive
        ),
    )


def _pipeline_config(args, **kw):
    from deploy.local import PipelineConfig

    return PipelineConfig(
        target=models.ModelSpec(args.target_model, args.target_device, args.target_dtype),
        draft=models.ModelSpec(args.draft_model, args.draft_device, args.draft_dtype),
        drafter=args.drafter,
        **kw,
    )


def cmd_generate(args) -> int:
    client = _client_security(args)
    if args.address:
        return _generate_at(args.address, args, client)
    with _local_pipeline(args, client) as pipeline:
        return _generate_at(pipeline.address, args, client)


def _local_pipeline(args, client: security.ClientSecurity):
    """The three services as local processes for this client; they require its token, if any."""
    from deploy.local import LocalPipeline

    if client.uses_tls:
        raise security.SecurityError("--tls* flags apply with --address; local services talk over loopback")
    log = (lambda *a: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    return LocalPipeline(_pipeline_config(args, auth_token=client.token), log=log)


def _generate_at(address: str, args, client: security.ClientSecurity) -> int:
    from specdec.v1 import orchestrator_pb2_grpc

    stub = orchestrator_pb2_grpc.OrchestratorStub(security.channel(address, client))
    request = _request(args)
    if args.stream and not args.json:
        stats = finish = None
        for chunk in stub.GenerateStream(request, timeout=args.timeout):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                stats, finish = chunk.stats, chunk.finish_reason
        print()
        _print_stats(stats, finish)
        return 0
    response = stub.Generate(request, timeout=args.timeout)
    if args.json:
        print(json.dumps(_response_json(response), ensure_ascii=False))
    else:
        print(response.text)
        _print_stats(response.stats, response.finish_reason)
    return 0


def _response_json(response) -> dict:
    s = response.stats
    return {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "finish_reason": response.finish_reason,
        "stats": {
            "rounds": s.rounds,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "tokens_per_second": s.tokens_per_second,
            "wall_seconds": s.wall_seconds,
        },
    }


def _print_stats(s, finish: str) -> None:
    print(
        f"[{s.generated_tokens} tokens in {s.wall_seconds:.2f} s = {s.tokens_per_second:.1f} tok/s | "
        f"{s.rounds} rounds, acceptance {s.acceptance_rate:.1%} of {s.draft_tokens} drafts, "
        f"{s.mean_accepted_length:.2f} tokens/round | finish: {finish}]",
        file=sys.stderr,
    )


# -- services ----------------------------------------------------------------------------
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stop_on_signal() -> threading.Event:
    """An event set by SIGTERM or SIGINT. The signals are unblocked in this (the main) thread:
    a parent may have started us with them blocked, and a blocked SIGTERM never arrives."""
    stop = threading.Event()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    return stop


def _wait(stop: threading.Event) -> None:
    """Wait for `stop`, waking twice a second: Python runs a signal handler only when the main
    thread runs, and a signal the kernel hands to another thread does not wake a plain wait()."""
    while not stop.wait(0.5):
        pass


def _serve_until_signal(
    server, address: str, ready_file: Path | None, what: str, telemetry=None, drain_timeout: float = 0.0
) -> int:
    """Serve until SIGTERM or SIGINT, then drain (health NOT_SERVING, new work refused,
    in-flight work finished within drain_timeout) and stop; exit code 0."""
    stop = _stop_on_signal()
    ready = {"address": address}
    if telemetry is not None and telemetry.metrics_address:
        ready["metrics_address"] = telemetry.metrics_address
        print(f"specdec: {what} metrics on http://{telemetry.metrics_address}/metrics", file=sys.stderr, flush=True)
    if ready_file:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.rename(ready_file)
    print(f"specdec: {what} serving on {address}", file=sys.stderr, flush=True)
    _wait(stop)
    print(f"specdec: {what} draining (up to {drain_timeout:g} s)", file=sys.stderr, flush=True)
    if not server.drain(drain_timeout):
        print(f"specdec: {what}: drain timed out; stopping with work in flight", file=sys.stderr, flush=True)
    server.stop(grace=1).wait()
    if telemetry is not None:
        telemetry.shutdown()  # flushes the last spans and metrics
    return 0


def _telemetry(args, role: str):
    from specdec import telemetry

    return telemetry.setup(role, args.metrics_port, args.host)


def _model_service(args, role: str) -> int:
    from specdec.limits import SessionLimits

    limits = SessionLimits(args.max_sessions, args.max_kv_tokens, args.session_ttl)  # checked before loading
    spec = models.ModelSpec(args.model, args.device, args.dtype)
    import torch

    torch.set_num_threads(args.threads)  # the one model worker owns these cores
    server_security = _server_security(args)
    telemetry = _telemetry(args, role)  # first: a bad OTEL_* setting fails before the model loads
    if role == "draft":
        from draft_service import drafters
        from draft_service.server import serve

        backend, drafter = drafters.make(args.drafter, spec)
        server, port = serve(
            backend, args.host, args.port, drafter, security=server_security, telemetry=telemetry, limits=limits
        )
    else:
        from specdec.backend import HFBackend
        from target_service.server import serve

        server, port = serve(
            HFBackend(spec), args.host, args.port, security=server_security, telemetry=telemetry, limits=limits
        )
    what = f"{role} service ({args.model})"
    address = f"{args.host}:{port}"
    return _serve_until_signal(server, address, args.ready_file, what, telemetry, args.drain_timeout)


def cmd_orchestrator(args) -> int:
    from orchestrator.server import connect, serve
    from specdec.limits import AdmissionLimits

    admission = AdmissionLimits(args.max_concurrent, args.max_queue)
    server_security = _server_security(args)
    client = _client_security(args, "service-", security.SERVICE_TOKEN_ENV, server_security.token)
    telemetry = _telemetry(args, "orchestrator")
    pair = connect(args.draft_address, args.target_address, security=client, telemetry=telemetry)
    server, port = serve(pair, args.host, args.port, server_security, telemetry=telemetry, admission=admission)
    address = f"{args.host}:{port}"
    return _serve_until_signal(server, address, args.ready_file, "orchestrator", telemetry, args.drain_timeout)


def cmd_serve(args) -> int:
    from deploy.local import LocalPipeline

    server_security = _server_security(args)  # fails here, before any process starts
    config = _pipeline_config(
        args,
        host=args.host,
        port=args.port,
        tls=_tls_files(args),
        auth_token=server_security.token,
        allow_insecure=args.allow_insecure,
        metrics_port=args.metrics_port,
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    stop = _stop_on_signal()
    with LocalPipeline(config, log=log) as pipeline:
        log(f"specdec: orchestrator ready at {pipeline.address} (Ctrl-C to stop)")
        _wait(stop)
        log("specdec: stopping")
    return 0


def cmd_bench(args) -> int:
    from bench.run import BenchConfig, main

    def floats(text):
        return tuple(float(x) for x in text.split(",") if x)

    config = BenchConfig(
        target=models.ModelSpec(args.target_model, args.target_device, args.target_dtype),
        draft=models.ModelSpec(args.draft_model, args.draft_device, args.draft_dtype),
        drafters=tuple(d for d in args.drafters.split(",") if d),
        ks=tuple(int(k) for k in floats(args.ks)),
        adaptive=not args.no_adaptive,
        temperatures=floats(args.temperatures),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        prompt_kinds=tuple(k for k in args.kinds.split(",") if k),
        hf_baselines=not args.no_hf,
        out=args.out,
    )
    if args.quick:
        config = replace(config, ks=(2, 4), temperatures=(0.0,), max_tokens=32, max_prompts=2, repeats=1)
    if args.concurrency:
        from bench import concurrency

        cc = concurrency.ConcurrencyConfig(
            concurrency=tuple(int(c) for c in floats(args.concurrency)),
            drafters=config.drafters,
            ks=config.ks,
            adaptive=config.adaptive,
            max_tokens=config.max_tokens,
            prompts=args.prompts,
            hf_baselines=config.hf_baselines,
            target=config.target,
            draft=config.draft,
            out=config.out,
        )
        print(concurrency.format_table(concurrency.run(cc)))
        return 0
    main(config)
    return 0


# -- security ----------------------------------------------------------------------------
def _tls_files(args) -> security.ServerTLSFiles:
    return security.ServerTLSFiles(args.tls_cert, args.tls_key, args.tls_client_ca)


def _server_security(args) -> security.ServerSecurity:
    """The server's TLS files and token, checked now: a bad setting fails before a model loads."""
    token = security.read_token(args.auth_token_file, os.environ.get(security.TOKEN_ENV))
    server_security = _tls_files(args).load(token, args.allow_insecure)
    security.check_bind(args.host, server_security)
    return server_security


def _client_security(
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


# -- load test ---------------------------------------------------------------------------
def cmd_loadtest(args) -> int:
    from specdec import loadtest

    config = loadtest.LoadTestConfig(args.requests, args.concurrency, args.time_limit)
    client = _client_security(args)
    if args.address:
        loadtest.check_target(args.address, args.allow_remote)
        return _loadtest_at(args.address, args, client, config)
    with _local_pipeline(args, client) as pipeline:
        return _loadtest_at(pipeline.address, args, client, config)


def _loadtest_at(address: str, args, client: security.ClientSecurity, config) -> int:
    from specdec import loadtest
    from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc

    stub = orchestrator_pb2_grpc.OrchestratorStub(security.channel(address, client))
    request = orchestrator_pb2.GenerateRequest(
        prompt=args.prompt,
        chat_template=True,
        sampling=model_pb2.SamplingParams(temperature=args.temperature),
        max_new_tokens=args.max_tokens,
        speculation=orchestrator_pb2.SpeculationParams(lookahead=args.lookahead),
    )
    report = loadtest.run(lambda timeout: len(stub.Generate(request, timeout=timeout).token_ids), config)
    print(json.dumps(report.as_dict()) if args.json else report.text())
    return 0 if report.ok else 1


def cmd_ray(args) -> int:
    """`specdec ray ...`; `up` secures its three servers and the orchestrator's service links as
    `orchestrator` does (TLS, mTLS, token; plaintext on the cluster's network only if allowed)."""
    if args.ray_command != "up":
        return ray_cli.run(args)
    token = security.read_token(args.auth_token_file, os.environ.get(security.TOKEN_ENV))
    server_security = _tls_files(args).load(token, args.allow_insecure)
    client = _client_security(args, "service-", security.SERVICE_TOKEN_ENV, server_security.token)
    return ray_cli.run(args, server_security, client)


COMMANDS = {
    "generate": cmd_generate,
    "serve": cmd_serve,
    "draft-service": lambda a: _model_service(a, "draft"),
    "target-service": lambda a: _model_service(a, "target"),
    "orchestrator": cmd_orchestrator,
    "bench": cmd_bench,
    "loadtest": cmd_loadtest,
    "ray": cmd_ray,
}

if __name__ == "__main__":
    sys.exit(main())
