"""Chains against trees through a running orchestrator, in one client process (scripts/gpu/trees.sh):
each configuration runs REPS times on each prompt; prints its tokens over its seconds (all its requests
pooled), tokens per round, and whether the greedy text equals the target alone's."""

import sys

import grpc

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a short poem about the sea."]
CONFIGS = [
    ("target alone", dict(disabled=True)),
    ("chain k=4 seq", dict(lookahead=4, overlap=False)),
    ("chain k=8 seq", dict(lookahead=8, overlap=False)),
    ("chain k=8 overlap", dict(lookahead=8)),
    ("tree 4/16", dict(lookahead=4, tree_nodes=16)),
    ("tree 8/16", dict(lookahead=8, tree_nodes=16)),
    ("tree 8/32", dict(lookahead=8, tree_nodes=32)),
    ("adaptive k=8 tree 16", dict(lookahead=8, tree_nodes=16, adaptive=True)),
]


def main(address: str, reps: int = 2, tokens: int = 128) -> None:
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
    alone = {}
    base = None
    for name, spec in CONFIGS:
        tokens_sum = seconds = rounds = 0
        same = True
        for prompt in PROMPTS:
            for _ in range(reps):
                req = orchestrator_pb2.GenerateRequest(
                    prompt=prompt, max_new_tokens=tokens, speculation=orchestrator_pb2.SpeculationParams(**spec)
                )
                r = stub.Generate(req, timeout=120)
                tokens_sum += r.stats.generated_tokens
                seconds += r.stats.wall_seconds
                rounds += r.stats.rounds
                ids = tuple(r.token_ids)
                same &= alone.setdefault(prompt, ids) == ids
        rate = tokens_sum / seconds
        base = base or rate
        print(
            f"{name:24s} {rate:7.1f} tok/s  {rate / base:5.2f}x alone  "
            f"{tokens_sum / rounds:5.2f} tok/round  greedy text equal: {same}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
