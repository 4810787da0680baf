"""`specdec bench compare`: specdec side by side with what a user would otherwise run, in one run.

On a fixed prompt set (bench/prompts.json: chat, code, summarisation of a given passage,
lists), for each temperature:
  (a) hf-target    target-only, in-process transformers `generate`;
      hf-static    the same with `cache_implementation="static"` (transformers then compiles the
                   forward on CUDA: the honest baseline on a GPU; on by default for a CUDA target);
  (b) hf-assisted  transformers assisted generation in-process with the same draft model
                   (prompt lookup for the ngram drafter; none for llama.cpp);
  (c) specdec-off  specdec through gRPC with speculation off (target service only: unpinned,
                   on every core, the honest counterpart of (a));
  (d) specdec      fixed lookahead k, and adaptive lookahead (k chosen per round), with
                   overlapped rounds allowed (the draft proposes round r + 1 while the target
                   verifies round r; on cores the services share, the price chooses overlapped
                   rounds on their shares or sequential rounds on every core, round by round);
                   specdec-seq: the same with sequential rounds only.
Next to (a), the one-process anchor on one core: hf-target-1core, the same `generate` pinned
to one core with one thread (the services share the machine's cores, as the orchestrator
chooses round by round, or run where --draft-cpus/--target-cpus pin them). Every row says its
threads: an in-process row's, or the services' mean over their forwards (draft+target).
The engines a CPU user would pick instead (bench.engines): llamacpp-target, llama.cpp
target-only on the F32 GGUF in process with (a)'s threads; and, given the binary,
llama-speculative, llama.cpp's speculative example with the Q8_0 draft, per fixed k and at its own
defaults (k column `defaults`).
Every method decodes the same prompt token ids; the methods alternate prompt by prompt.
What each row reports, the tables and the plot: bench.report.
Writes results.json, speedup.png and timeline.png (when the draft and the target are busy,
round by round, sequential vs overlapped: bench.timeline) to --out and prints the tables.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import costs, engines, timeline
from bench.report import (  # noqa: F401 - importable from bench.run
    Row,
    alpha_from_tokens_per_round,
    format_kinds_table,
    format_table,
    format_time_table,
    plot,
    summarise,
    theoretical_speedup,
)
from deploy.configs import ModelServiceConfig, target_runtime
from deploy.local import LocalPipeline, PipelineConfig, Placement
from specdec.limits import SessionLimits
from specdec.runtime import placement
from specdec.serving.security import ClientSecurity
from specdec.weights import models

PROMPTS = Path(__file__).with_name("prompts.json")
DOCUMENT = Path(__file__).with_name("long_chat.json")  # its system prompt: a store's return policy, 1,298 tokens
# The services' limits in every bench but ttft: every method runs the same prompts one after another,
# and with the prefix cache on all but the first would start from the first's keys and values.
COLD = SessionLimits(prefix_cache=False)
IN_PROCESS = ("hf", "llamacpp-target", "llama-speculative")  # rows that need no pipeline
SPECULATIVE_DEFAULTS = "defaults"  # the llama-speculative row run at its own defaults (its k column)


@dataclass(frozen=True)
class BenchConfig:
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    drafters: tuple[str, ...] = ("model", "ngram", "llamacpp")
    ks: tuple[int, ...] = (2, 4, 8)
    adaptive: bool = True
    measured: bool = False  # a row per drafter with the lookahead unset: the server's measured default k
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_tokens: int = 128
    repeats: int = 1
    prompt_kinds: tuple[str, ...] = ()  # empty: all
    prompt_tokens: tuple[int, ...] = ()  # each prompt at these lengths, a document before it (at_lengths)
    max_prompts: int = 0  # 0: all
    seed: int = 1
    out: Path = Path("bench-results")
    hf_baselines: bool = True
    hf_static: bool | None = None  # the hf-static rows (and the baseline); None: for a CUDA target
    overlap: tuple[bool, ...] = (True, False)  # overlapped rounds (specdec), sequential (specdec-seq)
    trees: tuple[int, ...] = ()  # draft trees' node budgets: specdec-tree rows, per fixed k (the depth)
    draft_placement: Placement = field(default_factory=Placement)  # default: LocalPipeline's split
    target_placement: Placement = field(default_factory=Placement)
    timeline: bool = True
    llamacpp_target: bool = True  # the llamacpp-target rows (llama-cpp-python on the F32 GGUF)
    llama_speculative: Path | None = None  # the llama-speculative binary: its rows, per fixed k
    target_backend: str = "auto"  # what runs the specdec rows' target service (deploy.configs.BACKENDS)
    target_compile: bool | None = None  # its --compile; None: by device

    def __post_init__(self):
        if not self.prompt_kinds:  # all: nothing to check (replace() builds a config again: no read then)
            return
        known = {p["kind"] for p in json.loads(PROMPTS.read_text())}
        unknown = [kind for kind in self.prompt_kinds if kind not in known]
        if unknown:  # else it started the pipeline and ran no prompt
            kinds = ", ".join(sorted(known))
            raise ValueError(f"--kinds: no prompt is of kind {', '.join(unknown)} (the kinds: {kinds})")


def load_prompts(config: BenchConfig) -> list[dict]:
    prompts = json.loads(PROMPTS.read_text())
    if config.prompt_kinds:
        prompts = [p for p in prompts if p["kind"] in config.prompt_kinds]
    return prompts[: config.max_prompts] if config.max_prompts else prompts


def at_lengths(prompts: list[dict], tokenizer, lengths: tuple[int, ...]) -> list[dict]:
    """Each prompt at each length N: a document before its question (the store's policy of
    long_chat.json, repeated past its 1,298 tokens), cut so that the chat-templated prompt is about
    N tokens, of kind "N tokens"; a length shorter than the question alone gives the question alone."""
    document = tokenizer.encode(json.loads(DOCUMENT.read_text())["system"], add_special_tokens=False)

    def with_document(room: int, question: str) -> str:
        excerpt = tokenizer.decode((document * (room // len(document) + 1))[:room])
        return f"A document:\n\n{excerpt}\n\n{question}"

    out = []
    for n in lengths:
        for p in prompts:
            text = p["prompt"]
            room = n - len(_chat_ids(tokenizer, with_document(0, text)))
            while room > 0:  # the excerpt's tokens may merge anew where it meets the text around it
                text = with_document(room, p["prompt"])
                excess = len(_chat_ids(tokenizer, text)) - n
                if excess <= 0:
                    break
                room, text = room - excess, p["prompt"]
            out.append({"kind": f"{n} tokens", "prompt": text})
    return out


# -- in-process transformers (a) and (b) ----------------------------------------------------
def hf_generate(model, ids, config: BenchConfig, temperature: float, one_core: bool = False, **extra) -> dict:
    import torch

    if one_core:  # the one-process anchor: the target's core, one thread, then back as it was
        cores, threads = placement.usable_cores(), torch.get_num_threads()
        placement.apply([cores[-1]], 1)
        try:
            return hf_generate(model, ids, config, temperature, **extra)
        finally:
            placement.apply(cores, threads)

    kwargs = dict(max_new_tokens=config.max_tokens, min_new_tokens=config.max_tokens, **extra)
    if temperature > 0:
        kwargs |= dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs |= dict(do_sample=False)
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        # On the model's device: generate puts its stop tokens where the ids are (a CPU tensor beside
        # a CUDA model failed the stopping criteria's isin).
        out = model.generate(torch.tensor([ids], device=model.device), **kwargs)
    wall = time.perf_counter() - t0
    n = out.shape[1] - len(ids)
    return {"tokens": n, "wall": wall, "tokens_per_second": n / wall, "threads": torch.get_num_threads()}


# -- specdec through gRPC (c) and (d) -----------------------------------------------------------
def _specdec_generate(
    stub, ids, config: BenchConfig, temperature: float, k: str, overlap: bool = True, tree_nodes: int = 0,
    constraint=None, cache: bool | None = None, sampling: dict | None = None, history: bool = False,
) -> dict:  # fmt: skip
    """One generation through the orchestrator (`constraint`: a model_pb2.Constraint, structured output;
    `cache`: the speculation cache on or off, None: the orchestrator's default; `sampling`: more
    SamplingParams fields, e.g. a penalty). `history`: it drafts from the store of earlier answers
    (SpeculationParams.history); off by default, as the benches send one prompt in several rows and
    repeats, and a later one would draft the answer an earlier one gave (the hybrid, the default, ran
    2.99x llama.cpp alone on a chat prompt so, every draft accepted)."""
    from specdec.v1 import model_pb2, orchestrator_pb2

    spec = orchestrator_pb2.SpeculationParams(
        disabled=k == "-", overlap=overlap, adaptive=k == "adaptive", history=history
    )
    if cache is not None:
        spec.cache = cache
    if k == "adaptive":
        spec.lookahead, spec.adaptive = max(config.ks), True
    elif k not in ("-", "measured"):  # measured: unset, the orchestrator's default
        spec.lookahead = int(k.split("/")[0])  # a tree's row: "depth/nodes"
    if tree_nodes:
        spec.tree_nodes = tree_nodes
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=ids),
        max_new_tokens=config.max_tokens,
        sampling=model_pb2.SamplingParams(temperature=temperature, **(sampling or {})),
        seed=config.seed,
        speculation=spec,
        constraint=constraint,
    )
    t0 = time.perf_counter()
    reply = stub.Generate(request)
    wall = time.perf_counter() - t0
    s = reply.stats
    n = len(reply.token_ids)
    run = {"tokens": n, "wall": wall, "tokens_per_second": n / wall, "finish": reply.finish_reason, "text": reply.text}
    # The rounds alone (prefill, tokenising and the RPC to the orchestrator excluded): what
    # overlapping changes.
    run["round_tokens_per_second"] = n / s.round_seconds if s.round_seconds else None
    rounds = max(s.rounds, 1)
    drafted = s.drafted_tokens  # what the draft's compute was spent on, thrown-away continuations included
    compute = s.draft_compute_seconds + s.target_compute_seconds
    # Overlapped, the two services compute at once: the round time less their sum says nothing.
    overhead = None if overlap and k != "-" else s.round_seconds - compute
    # Where a round's time goes (ms a round): waiting on each service, of which their forwards and
    # their other work; the orchestrator; and the share of the machine's cores the forwards kept busy.
    cores = len(placement.usable_cores())
    run |= {
        "round_ms": 1000 * s.round_seconds / rounds,
        "draft_wait_ms": 1000 * s.draft_seconds / rounds,
        "target_wait_ms": 1000 * s.target_seconds / rounds,
        "draft_forward_ms": 1000 * s.draft_forward_seconds / rounds,
        "target_forward_ms": 1000 * s.target_forward_seconds / rounds,
        "service_ms": 1000 * (compute - s.draft_forward_seconds - s.target_forward_seconds) / rounds,
        "orchestrator_ms": 1000 * (s.round_seconds - s.draft_seconds - s.target_seconds) / rounds,
        # sequential rounds: the waits on the services less their compute (the RPCs, queueing)
        "rpc_ms": None if overhead is None else 1000 * (s.draft_seconds + s.target_seconds - compute) / rounds,
        "busy_cores": (s.draft_core_seconds + s.target_core_seconds) / (s.round_seconds * cores)
        if s.round_seconds
        else None,
        "mask_ms_per_token": 1000 * (s.draft_mask_seconds + s.target_mask_seconds) / n if n else None,
        "draft_mask_ms_per_token": 1000 * s.draft_mask_seconds / n if n else None,
        "target_mask_ms_per_token": 1000 * s.target_mask_seconds / n if n else None,
        "draft_threads": s.draft_core_seconds / s.draft_forward_seconds if s.draft_forward_seconds else None,
        "target_threads": s.target_core_seconds / s.target_forward_seconds if s.target_forward_seconds else None,
    }
    run |= {
        "cache_hit_rate": s.cache_hits / s.cache_branches if s.cache_branches else None,
        "cache_hits_per_round": s.cache_hits / rounds if s.cache_branches else None,
        "acceptance_rate": s.acceptance_rate if s.draft_tokens else None,
        "tokens_per_round": s.mean_accepted_length,
        "drafts_per_round": s.draft_tokens / rounds,
        "index_share": s.index_proposals / s.proposals if s.proposals else None,  # proposals that ran no forward
        "lookahead": s.lookahead,  # the k the rounds drafted at most (a measured row: the one chosen)
        "bytes_per_round": s.wire_bytes / rounds,
        "overhead_ms_per_round": None if overhead is None else 1000 * overhead / rounds,
        "draft_ms_per_token": 1000 * s.draft_compute_seconds / drafted if drafted else None,
        "target_ms_per_round": 1000 * s.target_compute_seconds / rounds,
        "overhead_fraction": overhead / s.round_seconds if overhead is not None and s.round_seconds else None,
        "cost_ratio": (
            (s.draft_compute_seconds / drafted) / (s.target_compute_seconds / rounds)
            if drafted and s.target_compute_seconds
            else None
        ),
    }
    return run


# -- the run --------------------------------------------------------------------------------------
def run(config: BenchConfig) -> dict:
    import grpc
    import torch
    from tqdm import tqdm

    from specdec.v1 import orchestrator_pb2_grpc

    prompts = load_prompts(config)
    target_model, tokenizer = models.load(config.target)
    if config.prompt_tokens:
        prompts = at_lengths(prompts, tokenizer, config.prompt_tokens)
    prompt_ids = [_chat_ids(tokenizer, p["prompt"]) for p in prompts]
    prompt_texts = [_chat_text(tokenizer, p["prompt"]) for p in prompts]
    threads = torch.get_num_threads()  # hf-target's; the llama.cpp engines get as many
    # The llama.cpp engines run the embedded model's GGUFs: only next to it as the target.
    default_target = config.target.model in models.ALIASES
    if config.llama_speculative and not default_target:
        raise ValueError("--llama-speculative runs the embedded model's GGUFs: it needs the default --target-model")
    llama_target = None
    if config.llamacpp_target and default_target:
        llama_target = engines.LlamaCppTarget(models.f32_gguf_path(), threads)
    draft_model = models.load(config.draft)[0] if config.hf_baselines and "model" in config.drafters else None

    ks = [str(k) for k in config.ks] + (["adaptive"] if config.adaptive else [])
    ks += ["measured"] if config.measured else []
    hf_static = config.hf_static if config.hf_static is not None else config.target.device.startswith("cuda")
    plan: list[tuple] = []  # (row key, where, extra)
    for t in config.temperatures:
        if config.hf_baselines:
            plan.append((("hf-target", "-", t, "-"), "hf", {}))
            if hf_static:
                plan.append((("hf-static", "-", t, "-"), "hf", {"cache_implementation": "static"}))
            plan.append((("hf-target-1core", "-", t, "-"), "hf", {"one_core": True}))
            if draft_model is not None:
                plan.append((("hf-assisted", "model", t, "auto"), "hf", {"assistant_model": draft_model}))
            if "ngram" in config.drafters:
                plan.append((("hf-assisted", "ngram", t, "10"), "hf", {"prompt_lookup_num_tokens": 10}))
        if llama_target is not None:
            plan.append((("llamacpp-target", "-", t, "-"), "llamacpp-target", {}))
        if config.llama_speculative:
            # per k, and at its own defaults (as a user runs it: its draft length and p-min)
            ks_speculative = [str(k) for k in config.ks] + [SPECULATIVE_DEFAULTS]
            plan += [(("llama-speculative", "llamacpp", t, k), "llama-speculative", {}) for k in ks_speculative]
        for i, drafter in enumerate(config.drafters):
            if i == 0:
                plan.append((("specdec-off", "-", t, "-"), drafter, {}))
            for overlap in config.overlap:
                method = "specdec" if overlap else "specdec-seq"
                plan += [((method, drafter, t, k), drafter, {"overlap": overlap}) for k in ks]
            # A tree of n nodes and depth k beside the chains (its rounds are sequential).
            extra = [{"overlap": False, "tree_nodes": n} for n in config.trees]
            plan += [
                (("specdec-tree", drafter, t, f"{k}/{x['tree_nodes']}"), drafter, x) for k in config.ks for x in extra
            ]

    rows = {key: Row(*key) for key, _, _ in plan}
    bar = tqdm(total=len(plan) * len(prompt_ids) * config.repeats, desc="bench", unit="gen", dynamic_ncols=True)
    with ExitStack() as stack:
        stubs = {}  # every pipeline is up for the whole run, so methods can alternate
        pipelines = {}
        for where in dict.fromkeys(w for _, w, _ in plan if w not in IN_PROCESS):
            cfg = PipelineConfig(
                target=config.target,
                draft=config.draft,
                drafter=where,
                draft_placement=config.draft_placement,
                target_placement=config.target_placement,
                target_backend=config.target_backend,
                target_compile=config.target_compile,
                session_limits=COLD,
            )
            pipelines[where] = stack.enter_context(LocalPipeline(cfg, log=lambda msg: bar.write(msg)))
            stubs[where] = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipelines[where].address))
        forward_costs = _forward_costs(config, pipelines, prompt_ids) if pipelines else {}
        # Methods alternate prompt by prompt: this machine's speed drifts by up to 2x over
        # minutes, and a drift then slows every method alike instead of the ones run last.
        # The first pass, on one prompt, warms every method up and is dropped.
        inputs = list(zip(prompts, prompt_ids, prompt_texts, strict=True))
        for rep in range(config.repeats + 1):
            for prompt, ids, text in inputs[: 1 if rep == 0 else None]:
                for key, where, extra in plan:
                    method, drafter, temperature, k = key
                    bar.set_postfix_str(f"{method} {drafter} T={temperature} k={k}")
                    if where == "hf":
                        result = hf_generate(target_model, ids, config, temperature, **extra)
                    elif where == "llamacpp-target":
                        result = llama_target.generate(ids, config.max_tokens, temperature, config.seed)
                        del result["token_ids"]
                        result["threads"] = threads
                    elif where == "llama-speculative":
                        result = engines.run_speculative(
                            config.llama_speculative, text, len(ids), config.max_tokens,
                            None if k == SPECULATIVE_DEFAULTS else int(k), temperature,
                            config.seed, threads,
                        )  # fmt: skip
                        if rep == 0:  # what was parsed, once per row
                            bar.write(f"llama-speculative T={temperature} k={k}: {result}")
                        result["threads"] = threads
                    else:
                        result = _specdec_generate(stubs[where], ids, config, temperature, k, **extra)
                    if rep > 0:
                        rows[key].runs.append(result | {"kind": prompt["kind"]})
                        bar.update(1)
        bar.close()
        timelines = _timelines(config, pipelines, prompt_ids[0]) if config.timeline and pipelines else {}
    results = summarise(config, rows, forward_costs)
    results["timelines"] = timelines
    return results


def _forward_costs(config: BenchConfig, pipelines: dict, prompt_ids: list[list[int]]) -> dict:
    """One-process costs (bench.costs), each model alone on its service's cores, for the rows'
    bounds: the target's verify of 1 to k_max + 1 tokens, each drafter's step; seconds. Where the
    services share the machine's cores (neither pinned, on a CPU of several: specdec.runtime.placement),
    also at their shares of the cores ("target_share", "draft_share"): overlapped rounds run there."""
    widths = sorted({1, 2, 3, 5, 9} | {k + 1 for k in config.ks})
    context = round(statistics.mean(map(len, prompt_ids))) + config.max_tokens // 2
    out: dict = {"context": context, "draft": {}, "draft_share": {}}
    cores = placement.usable_cores()
    for drafter, pipeline in pipelines.items():
        draft_place, target_place = pipeline.placements
        shared = not (draft_place.cpus or target_place.cpus) and config.target.device == "cpu" and len(cores) > 1
        shares = placement.split_threads(len(cores)) if shared else None
        if "target" not in out:
            target = ModelServiceConfig(
                "target", config.target, cpus=_cores(target_place), threads=target_place.threads,
                backend=config.target_backend, compile=config.target_compile,
            )  # fmt: skip
            out["target"] = costs.measure(target, widths, context)
            if shares:
                out["target_share"] = costs.measure(replace(target, threads=shares[1]), widths, context)
        if drafter != "ngram":  # a lookup, no model: its step costs next to nothing
            draft = ModelServiceConfig(
                "draft", config.draft, drafter, cpus=_cores(draft_place), threads=draft_place.threads
            )
            out["draft"][drafter] = costs.measure(draft, [1], context)[1]
            if shares:
                out["draft_share"][drafter] = costs.measure(replace(draft, threads=shares[0]), [1], context)[1]
    return out


def _cores(place: Placement) -> tuple[int, ...] | None:
    return placement.parse_cpus(place.cpus) if place.cpus else None


def _timelines(config: BenchConfig, pipelines: dict, ids: list[int]) -> dict:
    """Sequential and overlapped rounds of one generation (the llama.cpp drafter if it ran,
    else the first), at the largest fixed k: busy spans of each service, round ends."""
    drafter = "llamacpp" if "llamacpp" in pipelines else next(iter(pipelines))
    addresses = pipelines[drafter].addresses
    services = ClientSecurity(token=pipelines[drafter].service_token)  # the model services require it
    k = max(config.ks)
    out = {}
    for overlap in (False, True):
        spans, ends = timeline.record(
            addresses["draft"], addresses["target"], ids, k, overlap, config.max_tokens, security=services
        )
        title = f"{drafter} k={k} {'overlapped' if overlap else 'sequential'}"
        out[title] = {"spans": [asdict(s) for s in spans], "round_ends": ends}
    return out


def _chat_text(tokenizer, prompt: str) -> str:
    """The text _chat_ids tokenizes: the chat template applied (for engines that take text)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return prompt


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)
    return tokenizer.encode(prompt)


# -- report ---------------------------------------------------------------------------------------
def main(config: BenchConfig) -> dict:
    results = run(config)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, config.out / "speedup.png")
    runtime = target_runtime(config.target, config.target_backend)
    backend = "llama.cpp (the F32 GGUF)" if runtime == "llamacpp" else "transformers"
    print(f"specdec rows: the target service runs {backend}")
    if fc := results["forward_costs"]:
        verify = ", ".join(f"{w}: {1000 * t:.1f}" for w, t in sorted(fc["target"].items()))
        drafts = ", ".join(f"{d} {1000 * t:.1f}" for d, t in fc["draft"].items()) or "-"
        print(f"one-process costs, each alone on its service's cores (context {fc['context']}, ms): "
              f"target verify by tokens {verify}; draft step {drafts}")  # fmt: skip
    print(f"speedup: over {results['baseline']}")
    print(format_table(results))
    print("\nwhere a round's time goes (ms a round, medians over generations)\n" + format_time_table(results))
    if kinds := format_kinds_table(results):
        print(f"\nspeedup over {results['baseline']} by prompt kind\n" + kinds)
    written = [config.out / "results.json", config.out / "speedup.png"]
    if results.get("timelines"):
        recorded = results["timelines"].items()
        timeline.plot(
            {t: ([timeline.Span(**s) for s in v["spans"]], v["round_ends"]) for t, v in recorded},
            config.out / "timeline.png",
        )
        written.append(config.out / "timeline.png")
    print(f"\nwrote {', '.join(map(str, written))}")
    return results
