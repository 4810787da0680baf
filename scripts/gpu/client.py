"""Speculation's modes through a running orchestrator, in one client process (scripts/gpu/trees.sh,
scripts/gpu/wide.sh).

    python3 scripts/gpu/client.py ADDRESS [--set chains|trees|fuse] [--reps 2] [--tokens 128] \
        [--concurrency 1,4,16] [--load-modes N]

Each configuration of the set runs REPS times on each prompt, one request at a time; prints its
tokens over its seconds (all its requests pooled), tokens per round, the target's compute a round,
and whether the greedy text equals the target alone's. With --concurrency, each of the set's
load configurations then runs with C clients at once (each sending REPS requests): the tokens of all
over the wall time."""

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

# Two that the embedded model answers at length (raw, it ends "Write a short poem about the sea." at once).
PROMPTS = ["Explain how a refrigerator keeps food cold.", "The history of the printing press"]
ALONE = ("target alone", dict(disabled=True))
SETS = {
    "trees": [
        ALONE,
        ("chain k=4 seq", dict(lookahead=4, overlap=False)),
        ("chain k=8 seq", dict(lookahead=8, overlap=False)),
        ("chain k=8 overlap", dict(lookahead=8)),
        ("tree 4/16", dict(lookahead=4, tree_nodes=16)),
        ("tree 8/16", dict(lookahead=8, tree_nodes=16)),
        ("tree 8/32", dict(lookahead=8, tree_nodes=32)),
        ("adaptive k=8 tree 16", dict(lookahead=8, tree_nodes=16, adaptive=True)),
    ],
    "chains": [
        ALONE,
        ("k=4 seq", dict(lookahead=4, overlap=False)),
        ("k=8 seq", dict(lookahead=8, overlap=False)),
        ("k=12 seq", dict(lookahead=12, overlap=False)),
        ("k=16 seq", dict(lookahead=16, overlap=False)),
        ("k=4 overlap", dict(lookahead=4)),
        ("k=8 overlap", dict(lookahead=8)),
        ("adaptive k<=16 seq", dict(lookahead=16, adaptive=True, overlap=False)),
        ("adaptive k<=16 (default overlap)", dict(lookahead=16, adaptive=True)),
        ("server defaults", dict()),
    ],
    "fuse": [
        ALONE,
        ("k=8 seq", dict(lookahead=8, overlap=False)),
        ("k=16 seq", dict(lookahead=16, overlap=False)),
        ("adaptive k<=16 seq", dict(lookahead=16, adaptive=True, overlap=False)),
        ("server defaults", dict()),
    ],
}
LOAD = [ALONE, ("k=8 seq", dict(lookahead=8, overlap=False)), ("adaptive k<=16", dict(lookahead=16, adaptive=True))]


def request(prompt: str, tokens: int, spec: dict) -> orchestrator_pb2.GenerateRequest:
    speculation = orchestrator_pb2.SpeculationParams(**spec)
    return orchestrator_pb2.GenerateRequest(prompt=prompt, max_new_tokens=tokens, speculation=speculation)


def sequential(stub, configs, reps: int, tokens: int) -> None:
    alone, base = {}, None
    for name, spec in configs:
        tokens_sum = seconds = rounds = target = 0
        same = True
        for prompt in PROMPTS:
            for _ in range(reps):
                r = stub.Generate(request(prompt, tokens, spec), timeout=120)
                tokens_sum += r.stats.generated_tokens
                seconds += r.stats.wall_seconds
                rounds += r.stats.rounds
                target += r.stats.target_compute_seconds
                ids = tuple(r.token_ids)
                same &= alone.setdefault(prompt, ids) == ids
        rate = tokens_sum / seconds
        base = base or rate
        print(
            f"{name:34s} {rate:7.1f} tok/s  {rate / base:5.2f}x alone  {tokens_sum / rounds:5.2f} tok/round  "
            f"target {1000 * target / rounds:6.2f} ms/round  greedy text equal: {same}",
            flush=True,
        )


def under_load(stub, levels: list[int], reps: int, tokens: int, modes: int = len(LOAD)) -> None:
    for name, spec in LOAD[:modes]:
        for clients in levels:

            def one(i: int, name=name, spec=spec, clients=clients) -> tuple[int, int]:
                made = failed = 0
                for j in range(reps):
                    try:
                        r = stub.Generate(request(PROMPTS[(i + j) % 2], tokens, spec), timeout=300)
                        made += r.stats.generated_tokens
                    except grpc.RpcError as err:
                        failed += 1
                        print(f"    {name}, {clients} clients: {err.code().name}: {err.details()}", flush=True)
                return made, failed

            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                made, failed = map(sum, zip(*pool.map(one, range(clients)), strict=True))
            wall = time.perf_counter() - start
            print(
                f"load {name:18s} {clients:3d} clients  {made / wall:8.1f} tok/s  "
                f"({made} tokens in {wall:.1f} s, {failed} failed)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address")
    parser.add_argument("--set", choices=sorted(SETS), default="chains")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="", help="comma-separated client counts (default: none)")
    parser.add_argument("--load-modes", type=int, default=len(LOAD), help="the first N of the load modes")
    args = parser.parse_args()
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(args.address))
    sequential(stub, SETS[args.set], args.reps, args.tokens)
    if args.concurrency:
        under_load(stub, [int(c) for c in args.concurrency.split(",")], args.reps, args.tokens, args.load_modes)


if __name__ == "__main__":
    main()
