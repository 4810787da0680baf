"""`specdec bench NAME`: the benches, one subcommand each, with its own flags and its own config
(bench/<NAME>.py's dataclass); each prints a table and writes its JSON to --out.

    compare      specdec beside transformers and llama.cpp on bench/prompts.json (bench.run)
    concurrency  clients at once on one pair (bench.concurrency)
    network      the split across a delayed link (bench.network)
    structured   speculation under a JSON schema and under a penalty (bench.structured)
    ttft         the time to the first token of a long chat (bench.ttft)
    serving      the serving path with stand-in models, clients under load (bench.serving)
    workloads    the drafters on work that copies text, HumanEval's and an agent's (bench.workloads)

The benches import torch and the models only when they run (the serving bench never: its models
are the services' stand-ins), so `specdec --help` stays light.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace
from pathlib import Path

from cli import options
from draft_service import METHODS
from orchestrator import RULES
from specdec.validation import MAX_LOOKAHEAD, MAX_TREE_NODES
from specdec.weights import models

DRAFTERS = "model,ngram,llamacpp"


def add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="the benchmarks: specdec against its baselines, under load, across a link, per feature",
        description="Run one benchmark: `specdec bench NAME --help` for its flags. Each prints a table and writes "
        "its JSON (and plots) to --out. Speeds are medians over prompts and repeats, client wall time.",
    )
    names = b.add_subparsers(dest="bench", metavar="NAME", required=True)
    for add in (_add_compare, _add_concurrency, _add_network, _add_structured, _add_ttft, _add_serving, _add_workloads):
        add(names)


def bench(args) -> int:
    return RUNS[args.bench](args)


# --- flag groups several benches share ---


def _floats(text: str, flag: str) -> tuple[float, ...]:
    """Finite numbers >= 0 (temperatures, round trips): `--rtt-ms -5` started the pipeline first."""
    try:
        values = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        values = None
    if values is None or not all(math.isfinite(v) and v >= 0 for v in values):
        raise SystemExit(f"specdec bench: {flag} is a comma list of numbers >= 0, not {text!r}")
    return values


def _ints(text: str, flag: str, low: int = 1, high: int | None = None) -> tuple[int, ...]:
    """Whole numbers in low..high, checked before anything starts (`--clients 1.5` ran 1 client,
    `--prompt-tokens 0` or `--trees -3` started the pipeline and every generation)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        values = None
    if values is None or not all(low <= v and (high is None or v <= high) for v in values):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise SystemExit(f"specdec bench: {flag} is a comma list of whole numbers {span}, not {text!r}")
    return values


def _add_pair(p: argparse.ArgumentParser, placement: bool = False, compile: bool = False) -> None:
    """The pair's models, the target's backend, and (where the bench pins services) their cores."""
    options.add_model_flags(p, models.DEFAULT_TARGET_DTYPE, "target-")
    options.add_model_flags(p, models.DEFAULT_DRAFT_DTYPE, "draft-")
    if placement:
        options.add_placement_flags(p, "target-")
        options.add_placement_flags(p, "draft-")
    options.add_backend_flag(p, "target-")
    if compile:
        options.add_compile_flag(p, "target-")


def _add_run_shape(p: argparse.ArgumentParser, max_tokens: int, repeats: int | None = 1, quick: str = "") -> None:
    """--max-tokens, --repeats (None: a bench that times one pass), --quick (where `quick` says what
    it runs) and --out."""
    p.add_argument(
        "--max-tokens",
        type=options.positive,
        default=max_tokens,
        help=f"new tokens a generation (default {max_tokens})",
    )
    if repeats is not None:
        p.add_argument(
            "--repeats",
            type=options.positive,
            default=repeats,
            help=f"timed passes over the prompts (default {repeats})",
        )
    if quick:
        p.add_argument("--quick", action="store_true", help=f"a small run that checks it works: {quick}")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default bench-results)")


def _add_drafters(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafters",
        default=DRAFTERS,
        help=f"comma list of --drafter's methods, a pipeline each ({', '.join(METHODS)}; auto is the hybrid; "
        f"default {DRAFTERS})",
    )


def _drafters(args) -> tuple[str, ...]:
    drafters = tuple(d for d in args.drafters.split(",") if d)
    unknown = [d for d in drafters if d not in METHODS]
    if not drafters or unknown:
        raise SystemExit(f"specdec bench: --drafters takes a comma list of {', '.join(METHODS)}, not {args.drafters!r}")
    return drafters


def _add_ks(p: argparse.ArgumentParser, default: str, adaptive: bool = True) -> None:
    p.add_argument("--ks", default=default, help=f"comma list of fixed lookaheads to run (default {default})")
    if adaptive:
        p.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-lookahead rows")


def _ks(args) -> tuple[int, ...]:
    ks = _ints(args.ks, "--ks", 1, MAX_LOOKAHEAD)  # adaptive's bound and the timelines' k: the largest
    if not ks:
        raise SystemExit(f"specdec bench: --ks needs one or more lookaheads in 1..{MAX_LOOKAHEAD} (e.g. 4 or 2,4,8)")
    return ks


def _temperatures(args) -> tuple[float, ...]:
    temperatures = _floats(args.temperatures, "--temperatures")
    if not temperatures:
        raise SystemExit("specdec bench: --temperatures needs one or more values >= 0 (0: greedy)")
    return temperatures


def _report(bench, config) -> int:
    """Run a bench module (bench.concurrency, network, structured, ttft) on its config; print its table."""
    print(bench.format_table(bench.run(config)))
    return 0


def _add_trees(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--trees", default="", metavar="NODES", help=help)


# --- compare: bench.run ---


def _add_compare(names) -> None:
    p = names.add_parser(
        "compare",
        help="specdec beside transformers and llama.cpp, one client (bench/run.py)",
        description="Side by side on bench/prompts.json: (a) transformers target-only generate (and with its static "
        "cache, hf-static, the baseline on CUDA), (b) transformers assisted generation with the same draft, (c) "
        "specdec with speculation off, (d) specdec with fixed and adaptive lookahead, per drafter, and what a CPU "
        "user would run instead: llama.cpp target-only (llamacpp-target) and llama.cpp's own speculative decoding "
        "(--llama-speculative). Prints a table, writes results.json and speedup.png.",
    )
    _add_drafters(p)
    _add_ks(p, "2,4,8")
    p.add_argument(
        "--measured",
        action="store_true",
        help="add a row per drafter with the lookahead unset (k 'measured'): the k a server without --lookahead "
        "gives a greedy chain, priced from the pair's measured costs and acceptance (its median in the JSON)",
    )
    _add_trees(p, "comma list of draft trees' node budgets: specdec-tree rows (k = depth/nodes), one a fixed k")
    p.add_argument("--temperatures", default="0,0.7", help="comma list (default 0,0.7)")
    p.add_argument("--kinds", default="", help="only prompts of these kinds: chat, code, summarisation, list")
    p.add_argument(
        "--prompt-tokens",
        default="",
        metavar="N,...",
        help="each prompt at these lengths (e.g. 20,250,1000,2000): a document (a store's return policy, repeated "
        "past its 1,298 tokens) before its question, to about N tokens in all; the speedups by length are the "
        "by-kind table (with --no-hf, over llama.cpp's target alone)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the in-process transformers baselines")
    p.add_argument(
        "--hf-static",
        action=argparse.BooleanOptionalAction,
        help="the hf-static rows: transformers generate with its static cache (compiled on CUDA), then the "
        "baseline of the speedups (default: for a CUDA target)",
    )
    p.add_argument(
        "--overlap",
        choices=("both", "on", "off"),
        default="both",
        help="overlapped rounds (specdec rows), sequential (specdec-seq rows) or both (default)",
    )
    p.add_argument("--no-timeline", action="store_true", help="skip timeline.png (services busy, round by round)")
    p.add_argument(
        "--no-llamacpp-target",
        action="store_true",
        help="skip the llamacpp-target rows: llama.cpp target-only (llama-cpp-python) on the F32 GGUF of the "
        "embedded model, with hf-target's threads (run by default when the target is the embedded default)",
    )
    p.add_argument(
        "--llama-speculative",
        type=Path,
        metavar="PATH",
        help="the llama-speculative binary (`make llama-tools` builds it): adds its rows, llama.cpp's own "
        "speculative decoding with the F32 target and the Q8_0 draft GGUFs, per --ks (default: no such rows)",
    )
    _add_run_shape(p, 128, quick="the first 2 prompts (of --kinds), 32 tokens, greedy, k in {2, 4}")
    _add_pair(p, placement=True, compile=True)


def compare(args) -> int:
    from bench.run import BenchConfig  # torch and the models: only for this command
    from bench.run import main as run_bench

    binary = args.llama_speculative
    if binary and not (binary.is_file() and os.access(binary, os.X_OK)):
        raise SystemExit(f"specdec bench: --llama-speculative {binary} is not an executable (make llama-tools)")
    config = BenchConfig(
        target=options.model_spec(args, "target-"),
        draft=options.model_spec(args, "draft-"),
        drafters=_drafters(args),
        ks=_ks(args),
        adaptive=not args.no_adaptive,
        measured=args.measured,
        trees=_ints(args.trees, "--trees", 1, MAX_TREE_NODES),
        temperatures=_temperatures(args),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        prompt_kinds=tuple(k for k in args.kinds.split(",") if k),
        prompt_tokens=_ints(args.prompt_tokens, "--prompt-tokens"),
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
    run_bench(config)
    return 0


# --- concurrency: bench.concurrency ---


def _add_concurrency(names) -> None:
    p = names.add_parser(
        "concurrency",
        help="clients at once on one pair: tokens/s and latency per client count (bench/concurrency.py)",
        description="Concurrent clients on one pair of real models: speculation off, each of --ks and adaptive, per "
        "drafter, beside transformers' batched generate; aggregate tokens/s and p50/p99 latency per client count.",
    )
    p.add_argument("--clients", default="1,2,4,8", metavar="LIST", help="comma list of client counts (default 1,2,4,8)")
    _add_drafters(p)
    _add_ks(p, "4")
    p.add_argument(
        "--measured",
        action="store_true",
        help="add a row per drafter with the lookahead unset: under load the k or plain rounds the pair measures",
    )
    _add_trees(p, "comma list of node budgets: adaptive rows with draft trees of each beside the chains-only one")
    p.add_argument("--prompts", type=options.positive, default=4, help="prompts cycled (default 4)")
    p.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="each client sends requests back to back for SECONDS (a steady load, where adaptive lookahead has "
        "measured both regimes) instead of one wave of requests",
    )
    p.add_argument("--no-hf", action="store_true", help="skip transformers' batched generate rows")
    _add_run_shape(p, 48, repeats=None)
    _add_pair(p, compile=True)


def concurrency(args) -> int:
    from bench import concurrency  # torch and the models

    if args.duration is not None and not 0 < args.duration < math.inf:
        raise SystemExit("specdec bench concurrency: --duration needs a number of seconds > 0")
    clients = _ints(args.clients, "--clients")
    if not clients:
        raise SystemExit("specdec bench concurrency: --clients needs one or more client counts")
    config = concurrency.ConcurrencyConfig(
        concurrency=clients,
        drafters=_drafters(args),
        ks=_ks(args),
        adaptive=not args.no_adaptive,
        measured=args.measured,
        trees=_ints(args.trees, "--trees", 1, MAX_TREE_NODES),
        max_tokens=args.max_tokens,
        prompts=args.prompts,
        duration=args.duration,
        hf_baselines=not args.no_hf,
        target=options.model_spec(args, "target-"),
        draft=options.model_spec(args, "draft-"),
        out=args.out,
        target_backend=args.target_backend,
        target_compile=args.target_compile,
    )
    return _report(concurrency, config)


# --- network: bench.network ---


def _add_network(names) -> None:
    p = names.add_parser(
        "network",
        help="the split across a delayed link, per round-trip time (bench/network.py)",
        description="The services on a core each, a delaying relay between the orchestrator and the target (or the "
        "draft: --remote), the target alone and the split (sequential and overlapped, per --ks; adaptive) across "
        "it, greedy, per round-trip time.",
    )
    p.add_argument(
        "--rtt-ms", default="0,1,5,20", metavar="LIST", help="comma list of round-trip times in ms (default 0,1,5,20)"
    )
    p.add_argument(
        "--remote",
        choices=("target", "draft"),
        default="target",
        help="the service across the link; the orchestrator is beside the other (default target)",
    )
    _add_ks(p, "4,8")
    p.add_argument(
        "--overlap",
        choices=("both", "on", "off"),
        default="both",
        help="overlapped rounds, sequential or both (default)",
    )
    options.add_drafter_flag(p)
    p.add_argument("--kinds", default="", help="only prompts of these kinds: chat, code, summarisation, list")
    _add_run_shape(p, 128, quick="the first 2 prompts, 32 tokens, k in {2, 4}")
    _add_pair(p, placement=True)


def network(args) -> int:
    from bench import network  # torch and the models

    config = network.NetworkConfig(
        rtts_ms=_floats(args.rtt_ms, "--rtt-ms"),
        remote=args.remote,
        ks=_ks(args),
        adaptive=not args.no_adaptive,
        overlap={"both": (True, False), "on": (True,), "off": (False,)}[args.overlap],
        drafter=args.drafter,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        prompt_kinds=tuple(k for k in args.kinds.split(",") if k),
        target=options.model_spec(args, "target-"),
        draft=options.model_spec(args, "draft-"),
        target_backend=args.target_backend,
        draft_placement=options.placement(args, "draft-"),
        target_placement=options.placement(args, "target-"),
        out=args.out,
    )
    return _report(
        network, replace(config, ks=(2, 4), max_tokens=32, max_prompts=2, repeats=1) if args.quick else config
    )


# --- structured: bench.structured ---


def _add_structured(names) -> None:
    p = names.add_parser(
        "structured",
        help="speculation under a JSON schema and under a penalty (bench/structured.py)",
        description="The target alone and speculation at --k, without and with a JSON schema, cut to the schema's "
        "length, and under frequency_penalty 0.5, per --temperatures: tokens/s, speedup, acceptance, the grammar "
        "masks' ms per token, the share of the speed-up each keeps.",
    )
    p.add_argument("--k", type=int, default=4, help="the lookahead of the speculation rows (default 4)")
    p.add_argument("--temperatures", default="0,0.7", help="comma list (default 0,0.7)")
    p.add_argument(
        "--rule",
        choices=RULES,
        default=RULES[0],
        help="the sampling rule of its sampled rows (default leviathan; invariant gives the target's own sample with "
        "and without speculation, so the answers are the same length in both)",
    )
    options.add_drafter_flag(p)
    _add_run_shape(p, 128, quick="1 prompt, 16 tokens, greedy")
    _add_pair(p)


def structured(args) -> int:
    from bench import structured  # torch and the models

    if not 1 <= args.k <= MAX_LOOKAHEAD:  # past it every generation was refused, once the pipeline ran
        raise SystemExit(f"specdec bench structured: --k needs a lookahead in 1..{MAX_LOOKAHEAD}, not {args.k}")
    config = structured.StructuredConfig(
        drafter=args.drafter,
        k=args.k,
        temperatures=_temperatures(args),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        target=options.model_spec(args, "target-"),
        draft=options.model_spec(args, "draft-"),
        out=args.out,
        rule=args.rule,
        target_backend=args.target_backend,
    )
    return _report(structured, structured.quick(config) if args.quick else config)


# --- ttft: bench.ttft ---


def _add_ttft(names) -> None:
    p = names.add_parser(
        "ttft",
        help="the time to the first token of a long chat, turn by turn (bench/ttft.py)",
        description="A chat with a 1,298-token system prompt (bench/long_chat.json) streamed from a client, turn by "
        "turn (the first, the next turn, the same request again, more turns), against the target's prefill in this "
        "process, the prefix cache on and off; --repeats conversations, answers of --max-tokens.",
    )
    p.add_argument(
        "--system-chars",
        type=options.non_negative,
        default=0,
        metavar="N",
        help="the system prompt cut to its first N characters (default 0: whole)",
    )
    options.add_drafter_flag(p)
    _add_run_shape(p, 48, repeats=3, quick="1 conversation of 2 turns, 8 tokens, the prefix cache on only")
    _add_pair(p)


def ttft(args) -> int:
    from bench import ttft  # torch and the models

    config = ttft.TTFTConfig(
        target=options.model_spec(args, "target-"),
        draft=options.model_spec(args, "draft-"),
        drafter=args.drafter,
        target_backend=args.target_backend,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        system_chars=args.system_chars,
        out=args.out,
    )
    return _report(ttft, ttft.quick(config) if args.quick else config)


# --- serving: bench.serving ---


def _add_serving(names) -> None:
    p = names.add_parser(
        "serving",
        help="the serving path under load, with stand-in models that cost no core (bench/serving.py)",
        description="Stand-in models (--standins: fixed-time forwards, as an accelerator costs its host a wait, not a "
        "core), `specdec serve`, closed-loop gRPC clients: tokens/s of each --methods per client count beside c x "
        "one client, and each process's CPU per token.",
    )
    p.add_argument("--clients", default="1,8,64", metavar="LIST", help="comma list of client counts (default 1,8,64)")
    p.add_argument(
        "--methods",
        default="off,k4,adaptive,default",
        metavar="LIST",
        help="comma list of off, kN (a fixed k), adaptive, default (default off,k4,adaptive,default)",
    )
    p.add_argument(
        "--standins",
        default="10,2,0.8",
        metavar="TARGET_MS,DRAFT_MS,AGREE",
        help="the target's and the draft's forward in ms and their agreement (default 10,2,0.8)",
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds measured a cell (default 15)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens an answer (default 64)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each cell, methods alternating; the table gives their medians and range (default 1)",
    )
    p.add_argument(
        "--settle",
        type=float,
        help="seconds of untimed load at each client count (after a cell's warm-up) before adaptive's and the "
        "default's cells, so the pair's regimes are measured at that load before they are timed, as a server "
        "under steady load has them (default 10: each regime's 4 s and 2 more; 0: none)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default bench-results)")


def _standins(text: str) -> tuple[float, float, float]:
    try:
        standins = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        standins = ()
    if len(standins) != 3:
        raise ValueError(f"--standins is TARGET_MS,DRAFT_MS,AGREE, three numbers (e.g. 10,2,0.8), not {text!r}")
    return standins


def serving(args) -> int:
    from bench import serving  # no torch in this process: the stand-ins run in the services

    try:
        target_ms, draft_ms, agreement = _standins(args.standins)
        config = serving.ServingConfig(
            clients=_ints(args.clients, "--clients"),
            methods=tuple(m for m in args.methods.split(",") if m),
            target_ms=target_ms,
            draft_ms=draft_ms,
            agreement=agreement,
            max_tokens=args.max_tokens,
            duration=args.duration,
            repeats=args.repeats,
            **({} if args.settle is None else {"settle": args.settle}),  # else the config's, from the policy's
        )
    except ValueError as err:
        raise SystemExit(f"specdec bench serving: {err}") from None
    cells = serving.run(config)
    print(serving.table(cells, config))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(serving.as_json(cells, config), indent=2))
    return 0


# --- workloads: bench.workloads ---


def _add_workloads(names) -> None:
    from bench.workloads import DRAFTERS, WORKLOADS  # light: names

    p = names.add_parser(
        "workloads",
        help="the drafters on work that copies text: HumanEval edits, an agent's resent request (bench/workloads.py)",
        description="HumanEval's functions rewritten with type hints and a docstring (humaneval), copied with one "
        "change (copy), an agent's request resent with one line changed (agent), and open-ended chat prompts (chat), "
        "greedy: tokens/s and acceptance of the target alone and of each drafter, and the speedup over llama.cpp "
        "alone on the same weights.",
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list (default {','.join(WORKLOADS)})")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma list (default {','.join(DRAFTERS)})")
    p.add_argument("--problems", type=int, default=6, help="HumanEval's first problems (default 6)")
    p.add_argument("--chats", type=int, default=2, help="bench/prompts.json's chat prompts (default 2)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens a generation at most (default 256)")
    p.add_argument("--no-llamacpp-alone", action="store_true", help="skip llama.cpp alone (the speedups' baseline)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default bench-results)")
    options.add_model_flags(p, models.DEFAULT_TARGET_DTYPE, "target-")
    options.add_model_flags(p, models.DEFAULT_DRAFT_DTYPE, "draft-")


def workloads(args) -> int:
    from bench import workloads  # torch and the models

    try:
        config = workloads.WorkloadsConfig(
            workloads=tuple(w for w in args.workloads.split(",") if w),
            drafters=tuple(d for d in args.drafters.split(",") if d),
            problems=args.problems,
            chats=args.chats,
            max_tokens=args.max_tokens,
            target=options.model_spec(args, "target-"),
            draft=options.model_spec(args, "draft-"),
            llamacpp_alone=not args.no_llamacpp_alone,
            out=args.out,
        )
    except ValueError as err:
        raise SystemExit(f"specdec bench workloads: {err}") from None
    return _report(workloads, config)


RUNS = {
    "compare": compare,
    "concurrency": concurrency,
    "network": network,
    "structured": structured,
    "ttft": ttft,
    "serving": serving,
    "workloads": workloads,
}
COMMANDS = {"bench": bench}
