"""The report of `specdec bench compare` (bench.run runs the rows): each row's figures, the tables, the plot.

Reported per row: tokens/s (median over prompts x repeats, client wall time, prefill
included), speedup over the baseline (median of per-prompt ratios to it on the same pass; the
baseline is hf-static where it ran, else (a)), rounds tok/s
(the orchestrator's round time only: what overlapping changes), ovl/seq and ovl/seq rounds
(overlapped rounds over the same k's sequential rounds, paired per prompt), the acceptance
rate, tokens per round, the measured draft/target cost ratio c (service compute time per
draft token / per target round), alpha (per-token acceptance under the i.i.d. model, solved
from tokens per round), the theoretical speedup (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))
(Leviathan et al. 2023), efficiency = measured / theoretical, bytes on the wire per round,
the bound from one-process costs (bench.costs: the target's verify and the draft's step, each
timed alone on its service's cores before the rows; overlapped rows tokens per round /
max(k draft steps, verify of k + 1), sequential rows tokens per round / (k draft steps +
verify); on shared cores the overlapped one at the services' shares, and a specdec row's bound
the better of the two) and the rounds' tokens/s over it ("of bound"), service compute time (draft ms per
token it proposed, thrown-away continuations included; target ms per round), and orchestrator
overhead per round (round time not spent computing in a model service; sequential rounds
only: overlapped, the services compute at once).
A second table says where a round's time goes, per specdec row (format_time_table): waits on each
service, their forwards and other work, the orchestrator, the RPCs, the cores left idle.

bench.run owns the plan, the pipelines and the generations; this module only reads their runs
(Row), so its functions are what the other benches (bench.structured, bench.ttft) share.
"""

from __future__ import annotations

import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import costs
from specdec.runtime import placement


@dataclass
class Row:
    method: str
    drafter: str
    temperature: float
    k: str  # "2", "4", ..., "adaptive", "measured" (lookahead unset), or "-" (no speculation)
    runs: list[dict] = field(default_factory=list)

    def median(self, key: str) -> float:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")


def alpha_from_tokens_per_round(tokens: float, k: float) -> float:
    """Solve (1 - a^(k+1)) / (1 - a) = tokens for a in [0, 1] (bisection; increasing in a)."""
    if k <= 0 or tokens <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(int(round(k)) + 1)) < tokens:
            lo = mid
        else:
            hi = mid
    return lo


def theoretical_speedup(alpha: float, k: float, cost_ratio: float) -> float:
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * cost_ratio + 1)


def _bound(row: Row, run: dict, forward_costs: dict) -> float:
    """The tokens/s a generation's rounds could reach at most (bench.costs), from its tokens and
    drafts per round: sequential rows, the draft's k steps then the verify, on every core;
    overlapped rows, the longer of the two, on the services' shares of the cores where they share
    them, and there the better of that and the sequential bound (the price picks either)."""
    tokens, k = run["tokens_per_round"], run["drafts_per_round"]
    draft, verify = forward_costs["draft"].get(row.drafter, 0.0), forward_costs["target"]
    sequential = costs.sequential_bound(tokens, k, draft, verify)
    if row.method != "specdec":
        return sequential
    if "target_share" not in forward_costs:
        return costs.overlap_bound(tokens, k, draft, verify)
    share = forward_costs["draft_share"].get(row.drafter, 0.0)
    return max(sequential, costs.overlap_bound(tokens, k, share, forward_costs["target_share"]))


def _threads(row: Row) -> str:
    """The threads a row ran with: an in-process row's, or the services' (draft+target, mean over
    their forwards: a row whose rounds took both placements lies between)."""
    if row.method.startswith("specdec"):
        d, t = row.median("draft_threads"), row.median("target_threads")
        return f"{d:.1f}+{t:.1f}" if d == d else f"{t:.1f}"
    return f"{row.median('threads'):.0f}"


def paired_speedup(row: Row, baseline: Row, kind: str | None = None, key: str = "tokens_per_second") -> float:
    """Median over (prompt, repeat) of tokens/s (`key`) over the baseline's on the same prompt
    in the same pass, run moments apart: a drift in machine speed cancels out of each ratio.
    `kind`: only the prompts of that kind."""
    pairs = zip(row.runs, baseline.runs, strict=True)
    ratios = [r[key] / b[key] for r, b in pairs if kind in (None, r["kind"]) and r[key] and b[key]]
    return statistics.median(ratios) if ratios else None


def summarise(config, rows: dict, forward_costs: dict | None = None) -> dict:
    """The results of a run: its `config` (bench.run.BenchConfig), environment and table of `rows`."""
    import torch

    table = []
    base = baseline_method(rows.values())
    baseline = {r.temperature: r for r in rows.values() if r.method == base}
    for row in rows.values():
        tps = row.median("tokens_per_second")
        entry = {
            "method": row.method,
            "drafter": row.drafter,
            "temperature": row.temperature,
            "k": row.k,
            "tokens_per_second": tps,
            "speedup": paired_speedup(row, baseline[row.temperature]) if row.temperature in baseline else None,
            "runs": len(row.runs),
            "threads": _threads(row),
        }
        if row.temperature in baseline:
            kinds = dict.fromkeys(r["kind"] for r in row.runs)
            entry["speedup_by_kind"] = {kind: paired_speedup(row, baseline[row.temperature], kind) for kind in kinds}
        if row.method == "llama-speculative":
            for key in ("acceptance_rate", "tokens_per_round", "drafts_per_round", "decode_tokens_per_second"):
                entry[key] = row.median(key)
        if row.method in ("specdec", "specdec-seq", "specdec-off"):
            for key in (
                "acceptance_rate",
                "tokens_per_round",
                "drafts_per_round",
                "lookahead",
                "cost_ratio",
                "bytes_per_round",
                "draft_ms_per_token",
                "target_ms_per_round",
                "overhead_ms_per_round",
                "overhead_fraction",
            ):
                entry[key] = row.median(key)
        if row.method in ("specdec", "specdec-seq", "specdec-off"):
            entry["round_tokens_per_second"] = row.median("round_tokens_per_second")
        if row.method.startswith("specdec"):
            entry["time"] = {key: row.median(key) for key in TIME_KEYS}
        seq = rows.get(("specdec-seq", row.drafter, row.temperature, row.k))
        if row.method == "specdec" and seq is not None:  # overlapped over sequential rounds, paired
            entry["overlap_speedup"] = paired_speedup(row, seq)
            entry["overlap_round_speedup"] = paired_speedup(row, seq, key="round_tokens_per_second")
        if row.method in ("specdec", "specdec-seq"):
            k = entry["drafts_per_round"]
            alpha = alpha_from_tokens_per_round(entry["tokens_per_round"], k)
            c = entry["cost_ratio"] if entry["cost_ratio"] == entry["cost_ratio"] else 0.0
            entry["alpha"] = alpha
            entry["theoretical_speedup"] = theoretical_speedup(alpha, k, c)
            if entry["speedup"]:
                entry["efficiency"] = entry["speedup"] / entry["theoretical_speedup"]
            if forward_costs and "target" in forward_costs:  # each generation against its own bound
                bounds = [_bound(row, r, forward_costs) for r in row.runs]
                entry["bound_tokens_per_second"] = statistics.median(bounds)
                ratios = [r["round_tokens_per_second"] / b for r, b in zip(row.runs, bounds, strict=True)]
                entry["bound_efficiency"] = statistics.median(ratios)
        table.append(entry)
    cores = placement.usable_cores()
    binary = str(config.llama_speculative) if config.llama_speculative else None
    return {
        "config": {**asdict(config), "out": str(config.out), "cores": cores, "llama_speculative": binary},
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "rows": table,
        "baseline": base,
        "forward_costs": forward_costs or {},
    }


def baseline_method(rows) -> str:
    """What speedups are over: hf-static where it ran (a GPU's honest baseline), else hf-target, and
    without the transformers rows (--no-hf) llama.cpp's target alone where it ran."""
    methods = {r.method for r in rows}
    for method in ("hf-static", "hf-target", "llamacpp-target"):
        if method in methods:
            return method
    return "hf-target"


COLUMNS = [
    ("method", "{}"),
    ("drafter", "{}"),
    ("temperature", "{:.1f}"),
    ("k", "{}"),
    ("threads", "{}"),
    ("tokens_per_second", "{:.2f}"),
    ("speedup", "{:.2f}x"),
    ("round_tokens_per_second", "{:.2f}"),
    ("overlap_speedup", "{:.2f}x"),
    ("overlap_round_speedup", "{:.2f}x"),
    ("acceptance_rate", "{:.2f}"),
    ("tokens_per_round", "{:.2f}"),
    ("cost_ratio", "{:.3f}"),
    ("alpha", "{:.3f}"),
    ("theoretical_speedup", "{:.2f}x"),
    ("efficiency", "{:.2f}"),
    ("bound_tokens_per_second", "{:.1f}"),
    ("bound_efficiency", "{:.2f}"),
    ("bytes_per_round", "{:.0f}"),
    ("draft_ms_per_token", "{:.1f}"),
    ("target_ms_per_round", "{:.1f}"),
    ("overhead_ms_per_round", "{:.2f}"),
    ("overhead_fraction", "{:.1%}"),
]
HEADERS = ["method", "drafter", "T", "k", "threads", "tok/s", "speedup", "rounds tok/s", "ovl/seq", "ovl/seq rounds",
           "accept", "tok/round", "c", "alpha", "theory", "eff", "bound", "of bound", "B/round", "draft ms",
           "target ms", "ovh ms", "ovh %"]  # fmt: skip


def format_table(results: dict) -> str:
    return format_rows(results["rows"], HEADERS, COLUMNS)


def format_rows(rows: list[dict], headers: list[str], columns: list[tuple[str, str]]) -> str:
    """An aligned table: a line a row, its `columns` (key, format) under `headers`; "-" for none."""
    lines = [headers]
    for row in rows:
        cells = []
        for key, fmt in columns:
            value = row.get(key)
            ok = value is not None and not (isinstance(value, float) and value != value)
            cells.append(fmt.format(value) if ok else "-")
        lines.append(cells)
    return _align(lines)


def _align(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


# Where a round's time goes, per specdec row (medians over generations, ms a round)
TIME_KEYS = ("round_ms", "draft_wait_ms", "target_wait_ms", "orchestrator_ms", "draft_forward_ms",
             "target_forward_ms", "service_ms", "rpc_ms", "busy_cores")  # fmt: skip
TIME_HEADERS = ["method", "drafter", "T", "k", "threads", "round", "wait draft", "wait target", "orchestrator",
                "draft fwd", "target fwd", "services other", "RPC+queue", "cores busy", "idle"]  # fmt: skip


def format_time_table(results: dict) -> str:
    """Where a round's time goes, one line per specdec row: the round; what the orchestrator
    waited on the draft and on the target, and the rest (its own work); the services' forwards
    (overlapped, at once: they do not add up to the round) and their other work; sequential rounds'
    waits beyond the services' compute (the RPCs, queueing); the machine's cores busy in forwards."""
    lines = [TIME_HEADERS]
    for r in results["rows"]:
        if "time" not in r:
            continue
        t = r["time"]
        cells = [r["method"], r["drafter"], f"{r['temperature']:.1f}", r["k"], r["threads"]]
        cells += ["-" if t[key] is None or t[key] != t[key] else f"{t[key]:.1f}" for key in TIME_KEYS[:-1]]
        busy = t["busy_cores"]
        cells += ["-", "-"] if busy is None or busy != busy else [f"{busy:.0%}", f"{1 - busy:.0%}"]
        lines.append(cells)
    return _align(lines)


def format_kinds_table(results: dict) -> str:
    """Speedup over (a) by prompt kind, one line per row."""
    rows = [r for r in results["rows"] if r.get("speedup_by_kind")]
    if not rows:
        return ""
    kinds = list(rows[0]["speedup_by_kind"])
    lines = [["method", "drafter", "T", "k", *kinds]]
    for r in rows:
        by_kind = [f"{r['speedup_by_kind'][kind]:.2f}x" for kind in kinds]
        lines.append([r["method"], r["drafter"], f"{r['temperature']:.1f}", r["k"], *by_kind])
    return _align(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["config"]["temperatures"]), figsize=(6 * 2, 4), squeeze=False)
    for ax, t in zip(axes[0], results["config"]["temperatures"], strict=False):
        # speedup is None without the transformers baseline (--no-hf): nothing to plot against
        rows = [r for r in results["rows"] if r["temperature"] == t and r["speedup"] is not None]
        for method in ("specdec", "specdec-seq", "llama-speculative"):
            for drafter in dict.fromkeys(r["drafter"] for r in rows if r["method"] == method):
                mine = [r for r in rows if r["method"] == method and r["drafter"] == drafter]
                fixed = sorted((int(r["k"]), r["speedup"]) for r in mine if r["k"].isdigit())
                style = {"specdec": "-", "specdec-seq": "--"}.get(method, "-.")
                label = f"{method} {drafter}"
                line = ax.plot([k for k, _ in fixed], [s for _, s in fixed], style, marker="o", label=label)[0]
                for r in mine:
                    if r["k"] == "adaptive":
                        ax.scatter([r["drafts_per_round"]], [r["speedup"]], marker="*", s=150, color=line.get_color(),
                                   label=f"{label} adaptive")  # fmt: skip
        for r in rows:
            if r["method"] in ("hf-assisted", "specdec-off", "hf-target-1core", "llamacpp-target", "hf-static"):
                style = {"specdec-off": ("gray", "--"), "hf-target-1core": ("red", ":"), "hf-static": ("blue", ":")}
                style |= {"llamacpp-target": ("green", "-.")}
                style |= {"model": ("black", "--"), "ngram": ("black", ":")}
                color, line = style[r["drafter"] if r["method"] == "hf-assisted" else r["method"]]
                label = f"{r['method']} {r['drafter']}"
                ax.axhline(r["speedup"], linestyle=line, linewidth=1, color=color, label=label)
        base = results.get("baseline", "hf-target")
        ax.axhline(1.0, color="red", linewidth=0.8, label=base)
        ax.set(title=f"temperature {t}", xlabel="lookahead k", ylabel=f"speedup over {base} (transformers)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
