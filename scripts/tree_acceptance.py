"""Tokens a round with draft trees against chains of the same verify size.

    python scripts/tree_acceptance.py [--draft-model smollm2-135m-int3] [--chains 8,16] [--trees 8:8,8:16]
        [--max-tokens 64] [--temperature 0] [--seeds 1]

Starts a local pipeline (deploy.local: the fp32 default target, the given draft as a transformers
model in fp32) and sends each of the bench's prompts (bench/prompts.json, chat-templated), one
request at a time, with sequential rounds: a chain of k drafts (a verify of k + 1 tokens) and trees
of DEPTH:NODES (a verify of NODES + 1). Prints the tokens committed a round for each, pooled over
prompts and seeds, each tree's ratio to the chain of its verify size, and, greedy, whether every
configuration's text equals the target alone's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc

from deploy.local import LocalPipeline, PipelineConfig
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights import models

PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft-model", default="smollm2-135m-int3", help="the draft (default smollm2-135m-int3)")
    p.add_argument("--chains", default="8,16", help="chain lookaheads k, comma-separated (default 8,16)")
    p.add_argument("--trees", default="8:8,8:16", help="trees DEPTH:NODES, comma-separated (default 8:8,8:16)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per generation (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per prompt (default 1)")
    args = p.parse_args()
    prompts = json.loads(PROMPTS.read_text())
    configs = {f"chain k={k}": dict(lookahead=int(k)) for k in args.chains.split(",")}
    for tree in args.trees.split(","):
        depth, nodes = tree.split(":")
        configs[f"tree {depth}:{nodes}"] = dict(lookahead=int(depth), tree_nodes=int(nodes))
    draft = models.ModelSpec(model=args.draft_model, dtype="float32")
    config = PipelineConfig(draft=draft, drafter="model", overlap=False)
    greedy = args.temperature == 0
    print(f"draft {args.draft_model}, T = {args.temperature}, {args.max_tokens} tokens, {len(prompts)} prompts")
    with LocalPipeline(config, log=lambda msg: None) as pipeline:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))

        def run(spec: dict, seed: int, prompt: str):
            request = orchestrator_pb2.GenerateRequest(
                prompt=prompt,
                chat_template=True,
                max_new_tokens=args.max_tokens,
                seed=seed,
                sampling=model_pb2.SamplingParams(temperature=args.temperature),
                speculation=orchestrator_pb2.SpeculationParams(overlap=False, **spec),
            )
            return stub.Generate(request, timeout=900)

        alone = {}
        if greedy:
            alone = {n: tuple(run(dict(disabled=True), 1, q["prompt"]).token_ids) for n, q in enumerate(prompts)}
        per_round = {}
        for name, spec in configs.items():
            committed = rounds = 0
            same = True
            for n, q in enumerate(prompts):
                for seed in range(1, args.seeds + 1):
                    r = run(spec, seed, q["prompt"])
                    committed, rounds = committed + r.stats.generated_tokens, rounds + r.stats.rounds
                    same &= not greedy or tuple(r.token_ids) == alone[n]
            per_round[name] = committed / max(1, rounds)
            size = spec.get("tree_nodes", spec["lookahead"]) + 1
            chain = per_round.get(f"chain k={size - 1}")
            ratio = f"{per_round[name] / chain:.3f}x the chain k={size - 1}" if chain and "tree" in name else ""
            text = f"  text equal to the target alone's: {same}" if greedy else ""
            print(f"{name:<14} verify {size:>3}: {per_round[name]:.3f} tokens/round  {ratio}{text}", flush=True)


if __name__ == "__main__":
    main()
