"""`specdec bench structured`: speculation under a JSON schema (structured output), on one pair.

On bench/prompts.json (each prompt asking for its answer as JSON), for each temperature, four
methods alternate prompt by prompt: the target alone through the services (speculation off) and
speculation at a fixed lookahead, each without and with a JSON schema (GenerateRequest.constraint:
both services mask their rows with it, the draft proposing under it). Reported per temperature
and schema: tokens/s of each (median over prompts x repeats, client wall time), speculation's
speedup over the target alone under the same constraint (median of per-prompt ratios),
acceptance, tokens per round, the grammar masks' cost per generated token (ms, both services:
computing the bitmasks and applying them, from GenerateStats.draft_mask_seconds and
target_mask_seconds) and, for the schema rows, the share of the unconstrained speed-up that
speculation keeps under the schema. The schema's answers are short (greedy: ~22 tokens), and
a short answer keeps less of speculation's speed-up whatever its constraint (the draft's prefill
is a larger share of it), so a third pair of runs, also alternating, generates each prompt's
answer without the schema cut to the schema's answer length (the target alone's under it):
`kept at its length` is the schema row's speed-up over that one's, the constraint's own cost:
like for like where the answers do not depend on speculation (greedy; the invariant rule,
StructuredConfig.rule), not for a Leviathan sample (speculation draws another one). A fourth pair,
without the schema and under `frequency_penalty` 0.5 (PENALTY: both services penalise their rows,
specdec.decoding.penalties), says what share of the speed-up speculation keeps under a penalty.
Prints a table and writes structured.json to --out.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.report import Row, format_rows, paired_speedup
from bench.run import COLD, BenchConfig, _chat_ids, _specdec_generate, load_prompts
from specdec.weights import models

ASK = "\nAnswer as JSON: an object with `answer` (a string) and `points` (a list of strings)."
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "points": {"type": "array", "items": {"type": "string"}}},
    "required": ["answer", "points"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class StructuredConfig:
    drafter: str = "auto"  # the default pair's: the hybrid (the llama.cpp Q8_0 draft and a suffix index)
    k: int = 4
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_tokens: int = 128
    max_prompts: int = 0  # 0: all
    repeats: int = 1
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    out: Path = Path("bench-results")
    seed: int = 1
    rule: str = "leviathan"  # the pipeline's sampling rule (orchestrator.RULES)
    target_backend: str = "auto"  # what runs the target service (deploy.configs.BACKENDS)


def run(config: StructuredConfig) -> dict:
    import grpc
    from tqdm import tqdm

    from deploy.local import LocalPipeline, PipelineConfig
    from specdec.v1 import model_pb2, orchestrator_pb2_grpc

    bench = BenchConfig(max_tokens=config.max_tokens, max_prompts=config.max_prompts, seed=config.seed)
    prompts = load_prompts(bench)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(config.target.model))
    ids = [_chat_ids(tokenizer, p["prompt"] + ASK) for p in prompts]
    schema = model_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    k = str(config.k)
    methods = [
        ("off", "-", None, FREE),
        ("off", "-", schema, SCHEMA_ROW),
        ("specdec", k, None, FREE),
        ("specdec", k, schema, SCHEMA_ROW),
        ("off", "-", None, PENALISED),
        ("specdec", k, None, PENALISED),
    ]
    cut = [("off", "-"), ("specdec", k)]  # without the schema, at the length of the target's answer under it
    runs: dict[tuple, list[dict]] = {}
    pipeline_config = PipelineConfig(
        target=config.target,
        draft=config.draft,
        drafter=config.drafter,
        session_limits=COLD,
        rule=config.rule,
        target_backend=config.target_backend,
    )
    runs_each = len(methods) + len(cut)
    bar = tqdm(total=len(config.temperatures) * runs_each * len(ids) * config.repeats, desc="structured")
    with LocalPipeline(pipeline_config, log=bar.write) as pipeline:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
        for rep in range(config.repeats + 1):  # the first pass, on one prompt, warms up and is dropped
            for prompt, prompt_ids in list(zip(prompts, ids, strict=True))[: 1 if rep == 0 else None]:
                for t in config.temperatures:
                    results = {}
                    for method, k, constraint, kind in methods:
                        sampling = PENALTY if kind == PENALISED else None
                        result = _specdec_generate(
                            stub, prompt_ids, bench, t, k, constraint=constraint, sampling=sampling
                        )
                        if constraint is not None and result["finish"] == "stop":
                            json.loads(result["text"])  # the schema's output parses (it ended with it)
                        results[(t, method, kind)] = result
                    length = replace(bench, max_tokens=max(1, results[(t, "off", SCHEMA_ROW)]["tokens"]))
                    for method, k in cut:
                        results[(t, method, CUT)] = _specdec_generate(stub, prompt_ids, length, t, k)
                    if rep:
                        for key, result in results.items():
                            runs.setdefault(key, []).append(result | {"kind": prompt["kind"]})
                        bar.update(len(results))
    bar.close()
    return summarise(config, runs)


# the rows: without the schema, with it, cut to its length, and without it under PENALTY
FREE, SCHEMA_ROW, CUT, PENALISED = "no", "yes", "no, its length", "no, frequency_penalty 0.5"
PENALTY = {"frequency_penalty": 0.5}


def summarise(config: StructuredConfig, runs: dict) -> dict:
    def row(t, method, schema) -> Row:
        k = "-" if method == "off" else str(config.k)
        return Row(method, config.drafter, t, k, runs.get((t, method, schema), []))

    table = []
    for t in config.temperatures:
        speedups = {}
        for schema in (FREE, CUT, SCHEMA_ROW, PENALISED):
            off, spec = row(t, "off", schema), row(t, "specdec", schema)
            speedup = speedups[schema] = paired_speedup(spec, off) if spec.runs and off.runs else None
            entry = {
                "temperature": t,
                "schema": schema,
                "k": config.k,
                "off_tokens_per_second": off.median("tokens_per_second"),
                "tokens_per_second": spec.median("tokens_per_second"),
                "speedup": speedup,
                "acceptance_rate": spec.median("acceptance_rate"),
                "tokens_per_round": spec.median("tokens_per_round"),
                "mask_ms_per_token": spec.median("mask_ms_per_token") if schema == SCHEMA_ROW else None,
                "off_mask_ms_per_token": off.median("mask_ms_per_token") if schema == SCHEMA_ROW else None,
                "tokens": statistics.median([r["tokens"] for r in spec.runs]) if spec.runs else None,
            }
            if schema in (SCHEMA_ROW, PENALISED) and speedup:  # of the unconstrained speed-up (asked: >= 0.9)
                entry["kept"] = speedup / speedups[FREE] if speedups[FREE] else None
            if schema == SCHEMA_ROW and speedup:
                entry["kept_at_length"] = speedup / speedups[CUT] if speedups[CUT] else None
            table.append(entry)
    result = {"config": {**asdict(config), "out": str(config.out)}, "schema": SCHEMA, "rows": table}
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "structured.json").write_text(json.dumps(result, indent=2, default=str))
    return result


HEADERS = ["T", "schema", "k", "off tok/s", "spec tok/s", "speedup", "kept", "kept at its length", "accept",
           "tok/round", "mask ms/tok", "off mask ms/tok", "tokens"]  # fmt: skip
KEYS = [("temperature", "{:.1f}"), ("schema", "{}"), ("k", "{}"), ("off_tokens_per_second", "{:.2f}"),
        ("tokens_per_second", "{:.2f}"), ("speedup", "{:.2f}x"), ("kept", "{:.2f}"), ("kept_at_length", "{:.2f}"),
        ("acceptance_rate", "{:.2f}"),
        ("tokens_per_round", "{:.2f}"), ("mask_ms_per_token", "{:.3f}"), ("off_mask_ms_per_token", "{:.3f}"),
        ("tokens", "{:.0f}")]  # fmt: skip


def format_table(results: dict) -> str:
    return format_rows(results["rows"], HEADERS, KEYS)


def quick(config: StructuredConfig) -> StructuredConfig:
    """A check that it runs: one prompt, a few tokens, greedy."""
    return replace(config, temperatures=(0.0,), max_tokens=16, max_prompts=1)
