"""`specdec bench concurrency --clients 1,2,4,8`: throughput and latency as concurrent clients grow.

For each concurrency c, c clients at once send greedy `Generate` calls over gRPC (the first
--prompts prompts of bench/prompts.json, cycled; max(c, prompts) requests in all, c in
flight; with --duration, each client sends them back to back for that many seconds: a steady
load), for speculation off, each fixed k and adaptive k (and with --trees, adaptive k with draft
trees of each node budget: each round a tree or a chain, whichever measured faster; with
--measured, the lookahead unset: the server's default), per drafter. The methods of one c run
side by side (with --duration, half the time each in order and half in reverse: `schedule`), so a
column's ratios are not a drift of the machine between cells minutes apart. Reported per cell:
total tokens/s (all tokens over the wall time of the whole cell), per-request tokens/s
(median), p50 and p99 latency (nearest rank). Side by side, what a user would otherwise run
in one process: transformers `generate` of one request at a time (with the process's threads,
and pinned to one core with one thread, as the target service runs on 2 cores: the cost of
speculation off beyond its forwards), and of a left-padded batch of c prompts at once
(tokens/s of the batch); and where the target runs on llama.cpp (the default pair on a CPU), the
service's engine in process with c sessions decoded as one batch (their prefills included): the
bound of speculation off at c clients. Prints a table, writes concurrency.json and
concurrency.png (total tokens/s vs concurrency) to --out.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.run import COLD, BenchConfig, _chat_ids, _specdec_generate, hf_generate, load_prompts
from deploy import configs as deploy_configs
from specdec.limits import AdmissionLimits
from specdec.weights import models


@dataclass(frozen=True)
class ConcurrencyConfig:
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    drafters: tuple[str, ...] = ("llamacpp",)
    ks: tuple[int, ...] = (4,)
    adaptive: bool = True
    measured: bool = False  # a row with the lookahead unset: the server's default k
    trees: tuple[int, ...] = ()  # node budgets: adaptive rows with draft trees beside the chains-only one
    max_tokens: int = 48
    prompts: int = 4
    duration: float | None = None  # seconds each client sends back to back (None: one wave)
    hf_baselines: bool = True
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    out: Path = Path("bench-results")
    target_backend: str = "auto"  # what runs the target service (deploy.configs.BACKENDS)
    target_compile: bool | None = None


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _cell(requests: list, c: int, generate, duration: float | None = None) -> dict:
    """Run `generate(ids)` over the requests, c at a time (see _runs): tokens and latencies."""
    return summarise([_runs(requests, c, generate, duration)])


def _runs(requests: list, c: int, generate, duration: float | None = None) -> tuple[list[dict], float]:
    """Run `generate(ids)` over the requests, c at a time; with `duration`, each of c clients
    cycles through them from its own offset until `duration` seconds have passed. (The runs,
    the wall time.)

    One client runs on the calling thread: the in-process `generate` rows ran at 0.55-0.6x their
    speed on a pool thread once the main thread had run a forward (torch's OpenMP on a second
    thread: a service's forwards all run on its one model worker, specdec.serving.lifecycle)."""
    t0 = time.perf_counter()

    def client(i: int) -> list[dict]:
        done = []
        while time.perf_counter() - t0 < duration:
            done.append(generate(requests[(i + c * len(done)) % len(requests)]))
        return done

    def each(fn, items) -> list:  # fn over items, c at a time; one client on this thread
        if c == 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(c) as pool:
            return list(pool.map(fn, items))

    if duration is None:
        runs = each(generate, requests)
    else:
        runs = [run for done in each(client, range(c)) for run in done]
    return runs, time.perf_counter() - t0


def summarise(parts: list[tuple[list[dict], float]]) -> dict:
    """A cell from its parts' (runs, wall time): total tokens over the total wall time, the median
    request's tokens/s, p50 and p99 latency over every run."""
    runs = [run for done, _ in parts for run in done]
    wall = sum(seconds for _, seconds in parts)
    latencies = [r["wall"] for r in runs]
    return {
        "requests": len(runs),
        "tokens": sum(r["tokens"] for r in runs),
        "total_tokens_per_second": sum(r["tokens"] for r in runs) / wall,
        "request_tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
        "p50_latency": nearest_rank(latencies, 0.5),
        "p99_latency": nearest_rank(latencies, 0.99),
    }


def schedule(methods: int, concurrency: tuple[int, ...], duration: float | None) -> list[tuple[int, int, float | None]]:
    """The order of a pipeline's cells: (c, method, seconds), the methods of one c side by side, so
    a column's ratios are of cells run minutes apart at most (these machines drift by up to 2x over
    minutes). With a duration each method runs half of it in the methods' order, then half in the
    reverse order: every method's cell is centred on the same moment, and a steady drift slows
    them alike. A cell of one wave cannot be halved: the order alternates from one c to the next."""
    order = list(range(methods))
    if duration is None:
        return [(c, m, None) for i, c in enumerate(concurrency) for m in (order if i % 2 == 0 else order[::-1])]
    return [(c, m, duration / 2) for c in concurrency for m in order + order[::-1]]


def _hf_batch(model, tokenizer, batch: list[list[int]], max_tokens: int) -> dict:
    """generate of a left-padded batch: every row max_tokens new tokens."""
    import torch

    width = max(len(ids) for ids in batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    wall = time.perf_counter() - t0
    return {"total_tokens_per_second": len(batch) * max_tokens / wall, "p50_latency": wall, "p99_latency": wall}


def _llamacpp_batch(backend, requests: list[list[int]], c: int, max_tokens: int) -> dict:
    """The target service's own engine in this process (a specdec.runtime.llamacpp backend, its
    threads): the requests in waves of c (at most the sessions the service holds), each wave's prompts
    prefilled one after another in its chunks, then decoded greedily as one batched forward a step,
    max_tokens each: what c sessions cost the engine alone, the bound of speculation off at c
    clients. Every c runs the same prompts (a cell's clients cycle through them all), so its "x c=1"
    is the bound of speculation off's: one client's prefills weigh the same."""
    t0 = time.perf_counter()
    c = min(c, backend.max_sessions)  # the sessions the service holds: its orchestrator queues the rest
    for first in range(0, len(requests), c):
        _llamacpp_wave(backend, requests[first : first + c], max_tokens)
    wall = time.perf_counter() - t0
    return {
        "total_tokens_per_second": len(requests) * max_tokens / wall,
        "p50_latency": wall * c / len(requests),
        "p99_latency": wall * c / len(requests),
    }


def _llamacpp_wave(backend, batch: list[list[int]], max_tokens: int) -> None:
    import torch

    slots = [backend.new_cache() for _ in batch]
    last = []
    for slot, ids in zip(slots, batch, strict=True):
        for i in range(0, len(ids), backend.prefill_chunk):
            [rows] = backend.forward_batch([(slot, ids[i : i + backend.prefill_chunk], 1)])
        last.append(int(torch.argmax(rows[-1])))
    for _ in range(max_tokens - 1):
        rows = backend.forward_batch([(slot, [token], 1) for slot, token in zip(slots, last, strict=True)])
        last = [int(torch.argmax(r[-1])) for r in rows]
    for slot in slots:
        backend.release(slot)


def run(config: ConcurrencyConfig) -> dict:
    import grpc

    from deploy.local import LocalPipeline, PipelineConfig
    from specdec.v1 import orchestrator_pb2_grpc

    bench = BenchConfig(ks=config.ks, max_tokens=config.max_tokens, temperatures=(0.0,))
    model, tokenizer = models.load(config.target)
    prompt_ids = [_chat_ids(tokenizer, p["prompt"]) for p in load_prompts(bench)[: config.prompts]]
    rows: dict[str, dict] = {}

    def requests(c):
        return [prompt_ids[i % len(prompt_ids)] for i in range(max(c, len(prompt_ids)))]

    if config.hf_baselines:
        hf_generate(model, prompt_ids[0], bench, 0.0)  # warm-up
        one = _cell(requests(1), 1, lambda ids: hf_generate(model, ids, bench, 0.0))
        rows["hf-generate 1 request"] = {str(c): one for c in config.concurrency}
        # on the target service's core count: what speculation off costs beyond a forward
        one_core = _cell(requests(1), 1, lambda ids: hf_generate(model, ids, bench, 0.0, one_core=True))
        rows["hf-generate 1 request, 1 core"] = {str(c): one_core for c in config.concurrency}
        rows["hf-generate padded batch"] = {
            str(c): _hf_batch(model, tokenizer, requests(c)[:c], config.max_tokens) for c in config.concurrency
        }
    if deploy_configs.target_runtime(config.target, config.target_backend) == "llamacpp":
        # the engine alone, batched: what bounds speculation off under load (the prompts' prefills included)
        from specdec.runtime.llamacpp import LlamaCppBackend, sessions_for

        # loaded once, holding the sessions the pipelines' target holds
        backend = LlamaCppBackend(config.target, default_file=models.f32_gguf_path, sessions=sessions_for(COLD))
        rows["llama.cpp in process, batch of c"] = {
            str(c): _llamacpp_batch(backend, requests(c), c, config.max_tokens) for c in config.concurrency
        }
        del backend  # its model and caches freed before the pipelines start
    modes = [("-", 0)] + [(str(k), 0) for k in config.ks]
    if config.adaptive:
        modes += [("adaptive", 0)] + [("adaptive", n) for n in config.trees]
    if config.measured:
        modes += [("measured", 0)]
    with ExitStack() as stack:
        for i, drafter in enumerate(config.drafters):
            # Admit every client at once: the orchestrator's default (8 generating) would queue the rest.
            most = max(config.concurrency)
            admission = AdmissionLimits(max_concurrent=most, max_queue=most)
            cfg = PipelineConfig(
                target=config.target,
                draft=config.draft,
                drafter=drafter,
                admission=admission,
                target_backend=config.target_backend,
                target_compile=config.target_compile,
                session_limits=COLD,
            )
            pipeline = stack.enter_context(LocalPipeline(cfg, log=print))
            stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
            methods = []  # (row name, generate), in the table's order
            for mode, nodes in modes if i == 0 else modes[1:]:
                name = "specdec-off" if mode == "-" else f"specdec {drafter} k={mode}"
                name += f" tree {nodes}" if nodes else ""
                _specdec_generate(stub, prompt_ids[0], bench, 0.0, mode, tree_nodes=nodes)  # warm-up
                rows[name] = {}

                def generate(ids, stub=stub, mode=mode, nodes=nodes):
                    return _specdec_generate(stub, ids, bench, 0.0, mode, tree_nodes=nodes)

                methods.append((name, generate))
            parts: dict[tuple[str, int], list] = {}
            for c, m, seconds in schedule(len(methods), config.concurrency, config.duration):
                name, generate = methods[m]
                parts.setdefault((name, c), []).append(_runs(requests(c), c, generate, seconds))
                if len(parts[name, c]) == (1 if seconds is None else 2):
                    rows[name][str(c)] = summarise(parts[name, c])
                    print(f"{name} c={c}: {rows[name][str(c)]['total_tokens_per_second']:.1f} tok/s", flush=True)
            stack.close()  # one pipeline at a time: they share the cores
    results = {"config": {k: str(v) for k, v in asdict(config).items()}, "rows": rows}
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "concurrency.json").write_text(json.dumps(results, indent=2))
    plot(results, config.out / "concurrency.png")
    return results


def format_table(results: dict) -> str:
    lines = [["method", "c", "total tok/s", "x c=1", "req tok/s", "p50 s", "p99 s"]]
    for name, cells in results["rows"].items():
        base = cells[next(iter(cells))]["total_tokens_per_second"]
        for c, cell in cells.items():
            per = cell.get("request_tokens_per_second")
            lines.append(
                [
                    name,
                    c,
                    f"{cell['total_tokens_per_second']:.2f}",
                    f"{cell['total_tokens_per_second'] / base:.2f}x",
                    "-" if per is None else f"{per:.2f}",
                    f"{cell['p50_latency']:.2f}",
                    f"{cell['p99_latency']:.2f}",
                ]
            )
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, cells in results["rows"].items():
        cs = [int(c) for c in cells]
        ax.plot(cs, [cells[str(c)]["total_tokens_per_second"] for c in cs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("total tokens/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
