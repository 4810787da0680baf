"""`specdec`: the parser of every command, and how a failure becomes one line and exit code 1.

The client path (`generate --address`) imports grpc and the stubs, not torch: the commands
that host a model import it when they run (cli.serving).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import grpc

from cli import bench, generate, load, options, ray, serving
from specdec.errors import SpecdecError

EPILOG = """\
examples:
  specdec generate "Write a haiku about GPUs"          # local draft+target+orchestrator, default pair
  specdec generate "Hi" --json --max-tokens 32         # one JSON object with text and stats
  specdec serve --port 50051                           # the three services, until Ctrl-C
  specdec generate "Hi" --address 127.0.0.1:50051      # use a running orchestrator
  specdec status --address 127.0.0.1:50051             # ok, degraded (draft lost) or unavailable (target lost)
  specdec target-service --host 0.0.0.0 --port 50061 --tls-cert b.pem --tls-key b.key   # one service per host
  specdec draft-service --host 0.0.0.0 --port 50062 --tls-cert a.pem --tls-key a.key
  specdec orchestrator --port 50051 --draft-address hostA:50062 --target-address hostB:50061 --service-tls-ca ca.pem
  specdec loadtest --address 127.0.0.1:50051 --requests 64 --concurrency 16 --time-limit 300
  specdec chaos --streams 8 --kills 10                 # streams checked while draft and target are killed
  specdec ray up --draft-gpus 1 --target-gpus 1        # as Ray actors (see specdec ray up --help)

TLS, mutual TLS and bearer tokens: every server takes --tls-cert/--tls-key (TLS),
--tls-client-ca (mTLS) and --auth-token-file (or $SPECDEC_AUTH_TOKEN); clients take
--tls-ca, --tls-cert/--tls-key and --auth-token-file. Plaintext only on loopback unless
--allow-insecure.
"""

COMMANDS = {
    "generate": generate.run,
    "status": generate.status,
    **serving.COMMANDS,
    **bench.COMMANDS,
    **load.COMMANDS,
    "ray": ray.run,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Distributed speculative decoding: a draft model proposes, a target model "
        "verifies, and the output is distributed exactly as the target alone would sample it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    generate.add_status_parser(sub)
    serving.add_serve_parser(sub)
    serving.add_service_parsers(sub)
    bench.add_bench_parser(sub)
    serving.add_orchestrator_parser(sub)
    load.add_loadtest_parser(sub)
    load.add_chaos_parser(sub)
    ray.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options.apply_environment()
    # SIGTERM (`timeout`, `kill`, a CI job cancelled) unwinds as Ctrl-C does, so what a command
    # started (a bench's pipeline, `ray bench`'s cluster) is stopped on the way out; the servers
    # install their own drain in its place.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _run(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    """The command; a failure as one line and exit code 1. Its --ready-file says it serves only
    while it does: removed before it starts and once it stops (a reader of one left by the last
    run connected to a dead address)."""
    ready_file = getattr(args, "ready_file", None)
    try:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # where stdout is a pipe whose reader left: raised here, not at exit
        return code
    except grpc.RpcError as err:
        print(f"specdec: error: {err.code().name}: {_flagged(args, _reached(args, err.details()))}", file=sys.stderr)
        return 1
    except SpecdecError as err:
        print(f"specdec: error: {err.code.name}: {_flagged(args, err.message)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader stopped reading (`| head`): done, as other tools end there
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141  # 128 + SIGPIPE, as a shell reports such a tool
    except (RuntimeError, OSError, ValueError) as err:
        print(f"specdec: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _reached(args, message: str) -> str:
    """gRPC's "failed to connect to all addresses; last error: ...: <cause>" as the address the user gave."""
    address = getattr(args, "address", None)
    if address and message.startswith("failed to connect to all addresses"):
        if "handshake failed" in message.lower():  # its last words were "OK"
            return f"the TLS handshake with {address} failed (a server without TLS, or one --tls-ca does not trust)"
        return f"no orchestrator answers at {address} ({message.rsplit(': ', 1)[-1]})"
    return message


def _flagged(args, message: str) -> str:
    """A refusal of a request the command built from its flags names the flag beside the field."""
    return generate.name_flag(message) if args.command in ("generate", "loadtest") else message


if __name__ == "__main__":
    sys.exit(main())
