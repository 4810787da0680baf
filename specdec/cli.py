"""The `specdec` command line. argv and the environment are read here and nowhere else.

The client path (`generate --address`) imports only grpc and the stubs; torch and
transformers are imported by the commands that host a model.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

import grpc

from specdec import models

EPILOG = """\
examples:
  specdec generate "Write a haiku about GPUs"          # local draft+target+orchestrator, default pair
  specdec generate "Hi" --json --max-tokens 32         # one JSON object with text and stats
  specdec serve --port 50051                           # the three services, until Ctrl-C
  specdec generate "Hi" --address 127.0.0.1:50051      # use a running orchestrator
  specdec target-service --host 0.0.0.0 --port 50061   # one service per host:
  specdec draft-service --host 0.0.0.0 --port 50062
  specdec orchestrator --port 50051 --draft-address hostA:50062 --target-address hostB:50061
"""


def _add_model_flags(p: argparse.ArgumentParser, dtype: str, prefix: str = "") -> None:
    p.add_argument(
        f"--{prefix}model",
        default=models.DEFAULT_ALIAS,
        help=f"hub id, local path, or '{models.DEFAULT_ALIAS}' (the embedded default; default)",
    )
    p.add_argument(f"--{prefix}device", default="cpu", help="torch device: cpu or cuda:N (default cpu)")
    p.add_argument(f"--{prefix}dtype", default=dtype, choices=models.DTYPES, help=f"weight dtype (default {dtype})")


def _add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help=f"port to bind; 0 picks a free one (default {port})")
    p.add_argument("--ready-file", type=Path, help='write {"address": ...} here once serving')
    _add_metrics_flag(p, "serve Prometheus metrics on this port at /metrics (0 picks a free one; default: off)")


def _add_metrics_flag(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--metrics-port", type=int, default=None, help=text + "; traces: see OTEL_* in the README")


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
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    g.add_argument("--timeout", type=float, default=None, help="deadline for the request in seconds")
    _add_model_flags(g, models.DEFAULT_TARGET_DTYPE, "target-")
    _add_model_flags(g, models.DEFAULT_DRAFT_DTYPE, "draft-")

    s = sub.add_parser("serve", help="run draft, target and orchestrator locally until interrupted")
    s.add_argument("--host", default="127.0.0.1", help="orchestrator address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="orchestrator port (default 50051)")
    _add_metrics_flag(s, "Prometheus metrics: orchestrator on this port, target +1, draft +2 (default: off)")
    _add_model_flags(s, models.DEFAULT_TARGET_DTYPE, "target-")
    _add_model_flags(s, models.DEFAULT_DRAFT_DTYPE, "draft-")

    d = sub.add_parser("draft-service", help="run the draft model service alone")
    _add_server_flags(d, 50062)
    _add_model_flags(d, models.DEFAULT_DRAFT_DTYPE)
    t = sub.add_parser("target-service", help="run the target model service alone")
    _add_server_flags(t, 50061)
    _add_model_flags(t, models.DEFAULT_TARGET_DTYPE)

    o = sub.add_parser("orchestrator", help="run the orchestrator alone, against running services")
    _add_server_flags(o, 50051)
    o.add_argument("--target-address", required=True, help="HOST:PORT of the target service")
    o.add_argument("--draft-address", help="HOST:PORT of the draft service (omit: target-only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except grpc.RpcError as err:
        print(f"specdec: error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ConnectionError, TimeoutError, ValueError) as err:
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
        speculation=orchestrator_pb2.SpeculationParams(lookahead=args.lookahead, disabled=args.no_speculation),
    )


def cmd_generate(args) -> int:
    if args.address:
        return _generate_at(args.address, args)
    from deploy.local import LocalPipeline, PipelineConfig

    config = PipelineConfig(
        target=models.ModelSpec(args.target_model, args.target_device, args.target_dtype),
        draft=models.ModelSpec(args.draft_model, args.draft_device, args.draft_dtype),
    )
    log = (lambda *a: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    with LocalPipeline(config, log=log) as pipeline:
        return _generate_at(pipeline.address, args)


def _generate_at(address: str, args) -> int:
    from specdec.v1 import orchestrator_pb2_grpc

    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
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
def _serve_until_signal(server, address: str, ready_file: Path | None, what: str, telemetry=None) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready = {"address": address}
    if telemetry is not None and telemetry.metrics_address:
        ready["metrics_address"] = telemetry.metrics_address
        print(f"specdec: {what} metrics on http://{telemetry.metrics_address}/metrics", file=sys.stderr, flush=True)
    if ready_file:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.rename(ready_file)
    print(f"specdec: {what} serving on {address}", file=sys.stderr, flush=True)
    stop.wait()
    server.stop(grace=5).wait()
    if telemetry is not None:
        telemetry.shutdown()  # flushes the last spans and metrics
    return 0


def _telemetry(args, role: str):
    from specdec import telemetry

    return telemetry.setup(role, args.metrics_port, args.host)


def _model_service(args, role: str) -> int:
    telemetry = _telemetry(args, role)  # first: a bad OTEL_* setting fails before the model loads
    from specdec.backend import HFBackend

    backend = HFBackend(models.ModelSpec(args.model, args.device, args.dtype))
    if role == "draft":
        from draft_service.server import serve
    else:
        from target_service.server import serve
    server, port = serve(backend, args.host, args.port, telemetry=telemetry)
    what = f"{role} service ({args.model})"
    return _serve_until_signal(server, f"{args.host}:{port}", args.ready_file, what, telemetry)


def cmd_orchestrator(args) -> int:
    from orchestrator.server import connect, serve

    telemetry = _telemetry(args, "orchestrator")
    pair = connect(args.draft_address, args.target_address, telemetry=telemetry)
    server, port = serve(pair, args.host, args.port, telemetry=telemetry)
    return _serve_until_signal(server, f"{args.host}:{port}", args.ready_file, "orchestrator", telemetry)


def cmd_serve(args) -> int:
    from deploy.local import LocalPipeline, PipelineConfig

    config = PipelineConfig(
        target=models.ModelSpec(args.target_model, args.target_device, args.target_dtype),
        draft=models.ModelSpec(args.draft_model, args.draft_device, args.draft_dtype),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with LocalPipeline(config, log=log) as pipeline:
        log(f"specdec: orchestrator ready at {pipeline.address} (Ctrl-C to stop)")
        stop.wait()
        log("specdec: stopping")
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "serve": cmd_serve,
    "draft-service": lambda a: _model_service(a, "draft"),
    "target-service": lambda a: _model_service(a, "target"),
    "orchestrator": cmd_orchestrator,
}

if __name__ == "__main__":
    sys.exit(main())
