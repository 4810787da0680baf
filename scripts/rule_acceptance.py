"""What the drafter-invariant rule costs in acceptance against the Leviathan rule.

    python scripts/rule_acceptance.py [--seeds 4] [--max-tokens 64] [--lookahead 4] [--temperature 0.7]

Starts the default local pipeline (deploy.local: the llama.cpp Q8_0 draft, the fp32 target) and
sends each of the bench's prompts (bench/prompts.json, chat-templated) with `--seeds` seeds under
each rule, with a fixed lookahead and sequential rounds (no continuation's first token counted),
one request at a time. Prints, per prompt and overall, the acceptance (accepted / proposed drafts,
pooled over the seeds) and the tokens a round under each rule, and their ratio. The invariant rule
accepts a draft only when it equals the target's own Gumbel-max sample; Leviathan accepts it with
min(1, p/q): its acceptance is 1 - TV per position, the invariant rule's at least (1 - TV)/(1 + TV).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc

from deploy.local import LocalPipeline, PipelineConfig
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc

PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.json"
RULES = {"leviathan": orchestrator_pb2.RULE_LEVIATHAN, "invariant": orchestrator_pb2.RULE_INVARIANT}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=4, help="seeds per prompt and rule (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per generation (default 64)")
    p.add_argument("--lookahead", type=int, default=4, help="fixed k (default 4)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    args = p.parse_args()
    prompts = json.loads(PROMPTS.read_text())
    totals = {rule: [0, 0, 0, 0] for rule in RULES}  # accepted, drafted, committed, rounds
    print(f"k = {args.lookahead}, T = {args.temperature}, {args.max_tokens} tokens, {args.seeds} seeds a prompt")
    print(f"{'prompt':<16} {'leviathan':>10} {'invariant':>10} {'ratio':>6}   tokens/round lev / inv")
    with LocalPipeline(PipelineConfig(overlap=False), log=lambda msg: None) as pipeline:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
        for n, prompt in enumerate(prompts):
            row = {}
            for rule, value in RULES.items():
                counts = [0, 0, 0, 0]
                for seed in range(1, args.seeds + 1):
                    request = orchestrator_pb2.GenerateRequest(
                        prompt=prompt["prompt"],
                        chat_template=True,
                        max_new_tokens=args.max_tokens,
                        seed=seed,
                        sampling=model_pb2.SamplingParams(temperature=args.temperature),
                        speculation=orchestrator_pb2.SpeculationParams(lookahead=args.lookahead, rule=value),
                    )
                    s = stub.Generate(request, timeout=600).stats
                    for i, x in enumerate((s.accepted_tokens, s.draft_tokens, s.generated_tokens, s.rounds)):
                        counts[i] += x
                        totals[rule][i] += x
                row[rule] = counts
            lev, inv = (row[r][0] / max(1, row[r][1]) for r in RULES)
            per_round = " / ".join(f"{row[r][2] / max(1, row[r][3]):.2f}" for r in RULES)
            print(f"{n} {prompt['kind']:<14} {lev:>10.3f} {inv:>10.3f} {inv / lev:>6.2f}   {per_round}")
    lev, inv = (totals[r][0] / max(1, totals[r][1]) for r in RULES)
    per_round = " / ".join(f"{totals[r][2] / max(1, totals[r][3]):.2f}" for r in RULES)
    print(f"{'all':<16} {lev:>10.3f} {inv:>10.3f} {inv / lev:>6.2f}   {per_round}")


if __name__ == "__main__":
    main()
