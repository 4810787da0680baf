"""Time `specdec ray up` to the first token, and the recovery after a service actor is killed.

Run it on a quiet machine (on a busy one the figures mean nothing):

    python -m deploy.ray_timing                          # local cluster, default pair, CPU
    python -m deploy.ray_timing --kills 3 -- --draft-gpus 1 --target-gpus 1   # flags after -- go to `ray up`
    python -m deploy.ray_timing -- --address HEAD:6379 --allow-insecure ...    # a cluster (plaintext client)

It runs `specdec ray up --name timing --port 0 ...` as a user would, streams one greedy
generation, then for the target and for the draft, `--kills` times: starts a long stream,
kills the actor (Ray restarts it) once tokens flow, and measures how long the stream
stalled. It ends with `specdec ray down`, and prints one JSON object:
- up_seconds: `specdec ray up` from start until it printed the address (a local cluster's
  start included when there is no --address);
- first_token_seconds: from the start of `ray up` to the first streamed token;
- recovery_seconds[role]: per kill, from the kill until tokens flowed again (the actor's
  restart, model load included, plus re-opening the session by prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import grpc

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

NAME = "timing"


def specdec(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=os.environ)
    if out.returncode != 0:
        raise RuntimeError(f"specdec {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def stream_times(stub, max_new_tokens: int, on_chunk=None) -> list[float]:
    """Arrival time of each chunk of a greedy stream; on_chunk(i) is called after chunk i."""
    request = orchestrator_pb2.GenerateRequest(prompt="Tell me a long story.", chat_template=True,
                                               max_new_tokens=max_new_tokens)  # fmt: skip
    times = []
    for i, _ in enumerate(stub.GenerateStream(request)):
        times.append(time.perf_counter())
        if on_chunk:
            on_chunk(i)
    return times


def recovery(stub, role: str, max_new_tokens: int) -> float:
    import ray

    from deploy import ray_deploy

    killed = []

    def kill(i):
        if i == 3:
            killed.append(time.perf_counter())
            ray.kill(ray.get_actor(ray_deploy.actor_name(NAME, role)), no_restart=False)

    times = stream_times(stub, max_new_tokens, kill)
    after = [t for t in times if t > killed[0]]
    gaps = [b - a for a, b in zip([killed[0], *after], after, strict=False)]
    resumed = after[gaps.index(max(gaps))]  # the chunk that ended the longest stall
    return resumed - killed[0]


def _given_address(up_args: list[str]) -> str | None:
    for i, arg in enumerate(up_args):
        if arg.startswith("--address="):
            return arg.split("=", 1)[1]
        if arg == "--address" and i + 1 < len(up_args):
            return up_args[i + 1]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3, help="kills per role (default 3)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per timed stream (default 256)")
    parser.add_argument("up_args", nargs="*", help="flags for `specdec ray up` (after --)")
    args = parser.parse_args(argv)

    from deploy import ray_cluster, ray_deploy
    from specdec.weights import embedded, models

    # A command line of its own: like the `specdec` it runs, it takes the cache (where `ray up` keeps its state) from
    # $SPECDEC_CACHE.
    embedded.set_cache_dir(os.environ.get(embedded.CACHE_ENV))
    given = _given_address(args.up_args)
    t0 = time.perf_counter()
    address = specdec("ray", "up", "--name", NAME, "--port", "0", "--quiet", *args.up_args).split()[-1]
    result = {"up_seconds": time.perf_counter() - t0}
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
        result["first_token_seconds"] = stream_times(stub, 16)[0] - t0
        if given is None:  # the local cluster `ray up` started
            os.environ.update(ray_cluster.auth_env(dict(os.environ)))
        ray_deploy.connect(given or ray_cluster.load(models.cache_dir() / "ray" / f"{NAME}.json").address)
        result["recovery_seconds"] = {
            role: [recovery(stub, role, args.max_tokens) for _ in range(args.kills)] for role in ("target", "draft")
        }
    finally:
        import ray

        ray.shutdown()
        specdec("ray", "down", "--name", NAME, *(["--address", given] if given else []))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
