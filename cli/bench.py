"""`specdec bench` (bench.run) and `specdec loadtest` (bench.loadtest): the measuring commands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from bench import loadtest
from bench.chaos import ChaosConfig
from bench.chaos import run as run_chaos
from bench.chaos import text as chaos_text
from cli import options
from cli.generate import local_pipeline
from orchestrator import RULES
from specdec.serving import security
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights import models

DEFAULT_DRAFTERS = "model,ngram,llamacpp"


def add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="benchmark specdec against target-only and assisted generation",
        description="Side by side on bench/prompts.json: (a) transformers target-only generate (and with its static "
        "cache, hf-static, the baseline on CUDA), (b) transformers "
        "assisted generation with the same draft, (c) specdec with speculation off, (d) specdec with fixed and "
        "adaptive lookahead, per drafter, and what a CPU user would run instead: llama.cpp target-only "
        "(llamacpp-target) and llama.cpp's own speculative decoding (--llama-speculative). Prints a table, writes "
        "results.json and speedup.png.",
    )
    b.add_argument(
        "--quick", action="store_true", help="a small run: first 2 prompts (of --kinds), 32 tokens, greedy, k in {2, 4}"
    )
    b.add_argument("--drafters", default=DEFAULT_DRAFTERS, help="comma list of model, ngram, llamacpp")
    b.add_argument("--ks", default="2,4,8", help="fixed lookaheads to run (default 2,4,8)")
    b.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-lookahead rows")
    b.add_argument(
        "--measured",
        action="store_true",
        help="add a row per drafter with the lookahead unset (k 'measured'): the k a server without --lookahead "
        "gives a greedy chain, priced from the pair's measured costs and acceptance (its median in the JSON); "
        "with --concurrency, under load that k or plain rounds, as the pair measures them",
    )
    b.add_argument(
        "--trees",
        default="",
        metavar="NODES",
        help="comma list of draft trees' node budgets: specdec-tree rows (k = depth/nodes), one a fixed k, beside the "
        "chains; with --concurrency, adaptive rows with trees of each budget beside the chains-only one "
        "(default: none)",
    )
    b.add_argument("--temperatures", default="0,0.7", help="comma list (default 0,0.7)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per generation (default 128)")
    b.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (default 1)")
    b.add_argument("--kinds", default="", help="only prompts of these kinds: chat, code, summarisation, list")
    b.add_argument(
        "--prompt-tokens",
        default="",
        metavar="N,...",
        help="each prompt at these lengths (e.g. 20,250,1000,2000): a document (a store's return policy, repeated "
        "past its 1,298 tokens) before its question, to about N tokens in all; the speedups by length are the "
        "by-kind table (with --no-hf, over llama.cpp's target alone)",
    )
    b.add_argument("--no-hf", action="store_true", help="skip the in-process transformers baselines")
    b.add_argument(
        "--hf-static",
        action=argparse.BooleanOptionalAction,
        help="the hf-static rows: transformers generate with its static cache (compiled on CUDA), then the "
        "baseline of the speedups (default: for a CUDA target)",
    )
    b.add_argument(
        "--overlap",
        choices=("both", "on", "off"),
        default="both",
        help="overlapped rounds (specdec rows), sequential (specdec-seq rows) or both (default)",
    )
    b.add_argument("--no-timeline", action="store_true", help="skip timeline.png (services busy, round by round)")
    b.add_argument(
        "--no-llamacpp-target",
        action="store_true",
        help="skip the llamacpp-target rows: llama.cpp target-only (llama-cpp-python) on the F32 GGUF of the "
        "embedded model, with hf-target's threads (run by default when the target is the embedded default)",
    )
    b.add_argument(
        "--llama-speculative",
        type=Path,
        metavar="PATH",
        help="the llama-speculative binary (`make llama-tools` builds it): adds its rows, llama.cpp's own "
        "speculative decoding with the F32 target and the Q8_0 draft GGUFs, per --ks (default: no such rows)",
    )
    b.add_argument(
        "--concurrency",
        default="",
        help="comma list of concurrent clients (e.g. 1,2,4,8): the concurrency benchmark (bench/concurrency.py) "
        "instead, for speculation off, --ks and adaptive, per drafter",
    )
    b.add_argument("--prompts", type=int, default=4, help="with --concurrency: prompts cycled (default 4)")
    b.add_argument(
        "--rtt-ms",
        default="",
        metavar="LIST",
        help="comma list of round-trip times in ms (e.g. 0,1,5,20): the network benchmark (bench/network.py) "
        "instead: the services on a core each, a delaying relay between the orchestrator and the target (or the "
        "draft: --rtt-remote), the target alone and the split (sequential, overlapped: --overlap, per --ks; "
        "adaptive) across it, greedy",
    )
    b.add_argument(
        "--rtt-remote",
        choices=("target", "draft"),
        default="target",
        help="with --rtt-ms: the service across the link; the orchestrator is beside the other (default target)",
    )
    b.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="with --concurrency: each client sends requests back to back for SECONDS (a steady load, where "
        "adaptive lookahead has measured both regimes) instead of one wave of requests",
    )
    b.add_argument(
        "--structured",
        action="store_true",
        help="the structured-output benchmark (bench/structured.py) instead: the target alone and speculation at "
        "the first of --ks, without and with a JSON schema, per --temperatures (first --drafters, default the "
        "pair's): tokens/s, speedup, acceptance, the grammar masks' ms per token",
    )
    b.add_argument(
        "--structured-rule",
        choices=RULES,
        default=RULES[0],
        help="with --structured: the sampling rule of its sampled rows (default leviathan; invariant gives the "
        "target's own sample with and without speculation, so the answers are the same length in both)",
    )
    b.add_argument(
        "--ttft",
        action="store_true",
        help="the time-to-first-token benchmark (bench/ttft.py) instead: a chat with a 1,298-token system prompt "
        "(bench/long_chat.json) streamed from a client, turn by turn (the first, the next turn, the same request "
        "again, more turns), against the target's prefill in this process, the prefix cache on and off; "
        "--repeats conversations, answers of --max-tokens, the first of --drafters (default the pair's)",
    )
    b.add_argument(
        "--system-chars",
        type=int,
        default=0,
        metavar="N",
        help="with --ttft: the system prompt cut to its first N characters (default 0: whole)",
    )
    b.add_argument(
        "--serving",
        default="",
        metavar="CLIENTS",
        help="comma list of concurrent clients (e.g. 1,8,64,256): the serving-path benchmark (bench/serving.py) "
        "instead: stand-in models that cost no core (--standins), closed-loop gRPC clients, tokens/s of each "
        "--serving-methods beside c x one client, and each process's CPU per token; --duration s a cell (15)",
    )
    b.add_argument(
        "--serving-methods",
        default="off,k4,adaptive,default",
        metavar="LIST",
        help="with --serving: comma list of off, kN (a fixed k), adaptive, default (default off,k4,adaptive,default)",
    )
    b.add_argument(
        "--standins",
        default="10,2,0.8",
        metavar="TARGET_MS,DRAFT_MS,AGREE",
        help="with --serving: the target's and the draft's forward in ms and their agreement (default 10,2,0.8)",
    )
    b.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default bench-results)")
    options.add_model_flags(b, models.DEFAULT_TARGET_DTYPE, "target-")
    options.add_model_flags(b, models.DEFAULT_DRAFT_DTYPE, "draft-")
    options.add_placement_flags(b, "target-")
    options.add_placement_flags(b, "draft-")
    options.add_backend_flag(b, "target-")
    options.add_compile_flag(b, "target-")


def add_loadtest_parser(sub) -> None:
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
    options.add_lookahead_flag(lt)
    lt.add_argument("--json", action="store_true", help="print one JSON object")
    lt.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --address")
    options.add_pair_flags(lt)
    options.add_client_security_flags(lt)


def bench(args) -> int:
    def floats(text):
        return tuple(float(x) for x in text.split(",") if x)

    if args.serving:
        return _serving(args, floats)
    from bench.run import BenchConfig  # torch and the models: only for this command
    from bench.run import main as run_bench

    binary = args.llama_speculative
    if binary and not (binary.is_file() and os.access(binary, os.X_OK)):
        raise SystemExit(f"specdec bench: --llama-speculative {binary} is not an executable (make llama-tools)")
    if args.duration is not None and not (args.concurrency and 0 < args.duration < math.inf):
        raise SystemExit("specdec bench: --duration needs --concurrency and a number of seconds > 0 (or --serving)")
    ks = tuple(int(k) for k in floats(args.ks))
    if not ks or min(ks) < 1:  # adaptive lookahead's bound and the timelines' k are the largest
        raise SystemExit(f"specdec bench: --ks needs one or more lookaheads >= 1 (e.g. 4 or 2,4,8), not {args.ks!r}")

    config = BenchConfig(
        target=options.model_spec(args, "target-"),
        draft=options.model_spec(args, "draft-"),
        drafters=tuple(d for d in args.drafters.split(",") if d),
        ks=ks,
        adaptive=not args.no_adaptive,
        measured=args.measured,
        trees=tuple(int(n) for n in floats(args.trees)),
        temperatures=floats(args.temperatures),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        prompt_kinds=tuple(k for k in args.kinds.split(",") if k),
        prompt_tokens=tuple(int(n) for n in floats(args.prompt_tokens)),
        hf_baselines=not args.no_hf,
        hf_static=args.hf_static,
        out=args.out,
        overlap={"both": (True, False), "on": (True,), "off": (False,)}[args.overlap],
        draft_placement=options.placement(args, "draft-"),
        target_placement=options.placement(args, "target-"),
        timeline=not args.no_timeline,
        llamacpp_target=not args.no_llamacpp_target,
        llama_speculative=args.llama_speculative,
        target_backend=args.target_backend,
        target_compile=args.target_compile,
    )
    if args.quick:
        config = replace(config, ks=(2, 4), temperatures=(0.0,), max_tokens=32, max_prompts=2, repeats=1)
    if args.rtt_ms:
        from bench import network  # as bench.run: torch and the models

        nc = network.NetworkConfig(
            rtts_ms=floats(args.rtt_ms),
            remote=args.rtt_remote,
            ks=config.ks,
            adaptive=config.adaptive,
            overlap=config.overlap,
            drafter=config.drafters[0] if len(config.drafters) == 1 else "auto",
            max_tokens=config.max_tokens,
            repeats=config.repeats,
            prompt_kinds=config.prompt_kinds,
            max_prompts=config.max_prompts,
            target=config.target,
            draft=config.draft,
            target_backend=config.target_backend,
            draft_placement=config.draft_placement,
            target_placement=config.target_placement,
            out=config.out,
        )
        print(network.format_table(network.run(nc)))
        return 0
    if args.structured:
        from bench import structured  # as bench.run: torch and the models

        sc = structured.StructuredConfig(
            drafter=_one_drafter(args, config),
            k=config.ks[0],
            temperatures=config.temperatures,
            max_tokens=config.max_tokens,
            max_prompts=config.max_prompts,
            repeats=config.repeats,
            target=config.target,
            draft=config.draft,
            out=config.out,
            rule=args.structured_rule,
        )
        if args.quick:
            sc = structured.quick(sc)
        print(structured.format_table(structured.run(sc)))
        return 0
    if args.ttft:
        from bench import ttft  # as bench.run: torch and the models

        tc = ttft.TTFTConfig(
            target=config.target,
            draft=config.draft,
            drafter=_one_drafter(args, config),
            target_backend=config.target_backend,
            max_tokens=config.max_tokens,
            repeats=config.repeats,
            system_chars=args.system_chars,
            out=config.out,
        )
        if args.quick:
            tc = ttft.quick(tc)
        print(ttft.format_table(ttft.run(tc)))
        return 0
    if args.concurrency:
        from bench import concurrency  # as bench.run: torch and the models

        cc = concurrency.ConcurrencyConfig(
            concurrency=tuple(int(c) for c in floats(args.concurrency)),
            drafters=config.drafters,
            ks=config.ks,
            adaptive=config.adaptive,
            measured=config.measured,
            trees=config.trees,
            max_tokens=config.max_tokens,
            prompts=args.prompts,
            duration=args.duration,
            hf_baselines=config.hf_baselines,
            target=config.target,
            draft=config.draft,
            out=config.out,
            target_backend=config.target_backend,
            target_compile=config.target_compile,
        )
        print(concurrency.format_table(concurrency.run(cc)))
        return 0
    run_bench(config)
    return 0


def load_test(args) -> int:
    config = loadtest.LoadTestConfig(args.requests, args.concurrency, args.time_limit)
    client = options.client_security(args)
    if args.address:
        loadtest.check_target(args.address, args.allow_remote)
        return _load_test_at(args.address, args, client, config)
    with local_pipeline(args, client) as pipeline:
        return _load_test_at(pipeline.address, args, client, config)


def _load_test_at(address: str, args, client: security.ClientSecurity, config: loadtest.LoadTestConfig) -> int:
    stub = orchestrator_pb2_grpc.OrchestratorStub(security.channel(address, client))
    request = orchestrator_pb2.GenerateRequest(
        prompt=args.prompt,
        chat_template=True,
        sampling=model_pb2.SamplingParams(temperature=args.temperature),
        max_new_tokens=args.max_tokens,
        speculation=orchestrator_pb2.SpeculationParams(**options.given(lookahead=args.lookahead)),
    )
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
    c.add_argument("--streams", type=int, default=8, help="concurrent streaming clients (default 8)")
    c.add_argument("--requests-per-stream", type=int, default=3, help="distinct requests per client (default 3)")
    c.add_argument("--max-tokens", type=int, default=64, help="longest request, tokens (default 64)")
    c.add_argument("--kills", type=int, default=10, help="faults, draft and target alike (default 10)")
    c.add_argument(
        "--faults",
        default="kill",
        help="comma list of the faults, taken in turn: kill (SIGKILL; the supervisor restarts the service), stop "
        "(SIGSTOP for 0.5-3 s, then SIGCONT: a host that hangs), drop (the link to the orchestrator holds every "
        "packet for 0.5-3 s), slow (the link takes 0.2 or 2 s a message for 0.5-3 s) (default kill)",
    )
    c.add_argument("--duration", type=float, default=180.0, help="seconds the kills may take (default 180)")
    c.add_argument("--seed", type=int, default=1, help="the kill schedule, request lengths and sampling seeds")
    c.add_argument("--rss-slack-mb", type=float, default=64.0, help="memory growth allowed per service (default 64)")
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


COMMANDS = {"bench": bench, "loadtest": load_test, "chaos": chaos}


def _serving(args, floats) -> int:
    from bench import serving  # no torch in this process: the stand-ins run in the services

    try:
        target_ms, draft_ms, agreement = floats(args.standins)
        config = serving.ServingConfig(
            clients=tuple(int(c) for c in floats(args.serving)),
            methods=tuple(m for m in args.serving_methods.split(",") if m),
            target_ms=target_ms,
            draft_ms=draft_ms,
            agreement=agreement,
            max_tokens=args.max_tokens,
            duration=15.0 if args.duration is None else args.duration,
        )
    except ValueError as err:
        raise SystemExit(f"specdec bench --serving: {err}") from None
    cells = serving.run(config)
    print(serving.table(cells, config))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(serving.as_json(cells, config), indent=2))
    return 0


def _one_drafter(args, config) -> str:
    """The drafter of a bench that runs one (--structured, --ttft): the first of --drafters if
    given, else the default pair's ("auto")."""
    return config.drafters[0] if args.drafters != DEFAULT_DRAFTERS else "auto"
