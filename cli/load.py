"""`specdec loadtest` (bench.loadtest) and `specdec chaos` (bench.chaos): commands that put a stack
under load or faults and check what it answers."""

from __future__ import annotations

import json
import sys

from bench import loadtest
from bench.chaos import ChaosConfig
from bench.chaos import run as run_chaos
from bench.chaos import text as chaos_text
from cli import options
from cli.generate import local_pipeline
from specdec import validation
from specdec.serving import security
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc


def add_loadtest_parser(sub) -> None:
    lt = sub.add_parser(
        "loadtest",
        help="a bounded load test: N requests, C at a time, within a time limit",
        description="Send --requests Generate calls, --concurrency at a time, all ending by --time-limit; "
        "report throughput, p50/p99 latency and errors. Loopback targets only unless --allow-remote. "
        "Without --address, starts the three local processes first (not timed).",
    )
    lt.add_argument("--address", type=options.host_port, help="HOST:PORT of a running orchestrator")
    lt.add_argument("--requests", type=options.positive, default=32, help="requests in all (default 32)")
    lt.add_argument("--concurrency", type=options.positive, default=4, help="concurrent clients (default 4)")
    lt.add_argument(
        "--time-limit", type=options.positive_seconds, default=300.0, help="seconds for the whole run (default 300)"
    )
    lt.add_argument(
        "--prompt", default="Explain speculative decoding in three sentences.", help="prompt of every request"
    )
    lt.add_argument("--max-tokens", type=int, default=64, help="tokens per request at most (default 64)")
    lt.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    options.add_lookahead_flag(lt)
    lt.add_argument("--json", action="store_true", help="print one JSON object")
    lt.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --address")
    options.add_pair_flags(options.local_pipeline_group(lt, "loadtest"))
    options.add_client_security_flags(lt)


def load_test(args) -> int:
    config = loadtest.LoadTestConfig(args.requests, args.concurrency, args.time_limit)
    client = options.client_security(args)
    request = orchestrator_pb2.GenerateRequest(
        prompt=args.prompt,
        chat_template=True,
        sampling=model_pb2.SamplingParams(temperature=args.temperature),
        max_new_tokens=args.max_tokens,
        speculation=orchestrator_pb2.SpeculationParams(**options.given(lookahead=args.lookahead)),
    )
    validation.generate_request(request)  # refused now, not as every one of --requests calls
    if args.address:
        options.refuse_local_flags(args)
        loadtest.check_target(args.address, args.allow_remote)
        return _load_test_at(args.address, args, client, config, request)
    with local_pipeline(args, client) as pipeline:
        return _load_test_at(pipeline.address, args, client, config, request)


def _load_test_at(address: str, args, client: security.ClientSecurity, config: loadtest.LoadTestConfig, request) -> int:
    stub = orchestrator_pb2_grpc.OrchestratorStub(security.channel(address, client))
    report = loadtest.run(lambda timeout: len(stub.Generate(request, timeout=timeout).token_ids), config)
    print(json.dumps(report.as_dict()) if args.json else report.text())
    return 0 if report.ok else 1


def add_chaos_parser(sub) -> None:
    c = sub.add_parser(
        "chaos",
        help="concurrent streams while the draft and target are killed; checks nothing is lost",
        description="Start a supervised local stack, run every request once without faults (the reference), "
        "then again while the draft and the target are killed with SIGKILL (or, with --faults, stopped for "
        "seconds) at random times (--seed fixes the schedule). Checks every stream against the reference (each "
        "token once, in order, same output), zero sessions and resident memory back near its start afterwards; "
        "exits 1 if a check fails.",
    )
    c.add_argument("--streams", type=options.positive, default=8, help="concurrent streaming clients (default 8)")
    c.add_argument(
        "--requests-per-stream", type=options.positive, default=3, help="distinct requests per client (default 3)"
    )
    # >= 4: its requests ask for a quarter of it to all of it (bench.chaos)
    c.add_argument(
        "--max-tokens",
        type=options.whole(4, "chaos_tokens"),
        default=64,
        help="longest request, tokens, >= 4 (default 64)",
    )
    c.add_argument("--kills", type=options.non_negative, default=10, help="faults, draft and target alike (default 10)")
    c.add_argument(
        "--faults",
        default="kill",
        help="comma list of the faults, taken in turn: kill (SIGKILL; the supervisor restarts the service), stop "
        "(SIGSTOP for 0.5-3 s, then SIGCONT: a host that hangs), drop (the link to the orchestrator holds every "
        "packet for 0.5-3 s), slow (the link takes 0.2 or 2 s a message for 0.5-3 s) (default kill)",
    )
    c.add_argument(
        "--duration", type=options.positive_seconds, default=180.0, help="seconds the kills may take (default 180)"
    )
    c.add_argument("--seed", type=int, default=1, help="the kill schedule, request lengths and sampling seeds")
    c.add_argument(
        "--rss-slack-mb",
        type=options.finite(0, "megabytes", "megabytes"),
        default=64.0,
        help="memory growth allowed per service (default 64)",
    )
    c.add_argument("--json", action="store_true", help="print one JSON object")
    options.add_rule_flag(c)
    options.add_tree_flag(c)
    options.add_pair_flags(c)


def chaos(args) -> int:
    config = ChaosConfig(
        pipeline=options.pipeline_config(args, rule=args.rule, tree_nodes=args.tree),
        streams=args.streams,
        requests_per_stream=args.requests_per_stream,
        max_tokens=args.max_tokens,
        kills=args.kills,
        faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()),
        duration=args.duration,
        seed=args.seed,
        rss_slack_mb=args.rss_slack_mb,
    )
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = run_chaos(config, log=log)
    print(json.dumps(result) if args.json else chaos_text(result))
    return 0 if result["ok"] else 1


COMMANDS = {"loadtest": load_test, "chaos": chaos}
