"""Does a service slow down when the other one works? One-token forwards alone and under load.

    python scripts/contention.py [--reps 40] [--draft-cpu 0] [--target-cpu 1]

Overlapped rounds assume the draft on one core and the target on another work at once at the
speed each has alone. They share the memory bus and the last-level cache, so each may be
slower while the other runs. This times, pinned and with one thread each as `specdec bench`
places them, the draft's one-token forward (the llama.cpp Q8_0 GGUF, else the bf16 copy) and
the fp32 target's one-token forward, each first with the other core idle, then while a second
process runs the other model's forwards in a loop on the other core; it prints medians and the
slowdown. The cost a round pays is the loaded one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CONTEXT = [100 + i for i in range(80)]


def backend(role: str):
    from specdec.weights import models

    if role == "target":
        from specdec.runtime.backend import HFBackend

        return HFBackend(models.ModelSpec(dtype="float32"))
    try:
        from specdec.runtime.llamacpp import LlamaCppBackend

        return LlamaCppBackend(models.ModelSpec())
    except RuntimeError:
        from specdec.runtime.backend import HFBackend

        return HFBackend(models.ModelSpec(dtype="bfloat16"))


def one_token_times(model, reps: int) -> list[float]:
    cache = model.new_cache()
    model.forward(cache, CONTEXT, 1)
    times = []
    for _ in range(reps + 3):  # three warm-up forwards, dropped
        t0 = time.perf_counter()
        model.forward(cache, [7], 1)
        times.append(time.perf_counter() - t0)
        model.crop(cache, len(CONTEXT))
    return times[3:]


def pin(cpu: int) -> None:
    from specdec.runtime import placement

    placement.apply((cpu,), 1)


def loop(role: str, cpu: int) -> None:
    """The load: the other model's forwards, forever (until killed)."""
    pin(cpu)
    model = backend(role)
    print("ready", flush=True)
    while True:
        one_token_times(model, 20)


def measure(role: str, cpu: int, other: str, other_cpu: int, reps: int) -> tuple[float, float]:
    """Median one-token seconds of `role` on `cpu`: alone, then with `other` busy on other_cpu."""
    pin(cpu)
    model = backend(role)
    alone = statistics.median(one_token_times(model, reps))
    load = subprocess.Popen(
        [sys.executable, __file__, "--loop", other, "--cpu", str(other_cpu)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        if load.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {other} load process did not start")
        time.sleep(1.0)
        loaded = statistics.median(one_token_times(model, reps))
    finally:
        load.kill()
        load.wait()
    return alone, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=40, help="timed one-token forwards per measurement (median)")
    parser.add_argument("--draft-cpu", type=int, default=0)
    parser.add_argument("--target-cpu", type=int, default=1)
    parser.add_argument("--loop", choices=("draft", "target"), help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("draft", "target"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        loop(args.loop, args.cpu)
        return
    if args.role:  # one measurement, in a fresh process so the pinning and threads are its own
        cpu, other_cpu = (
            (args.draft_cpu, args.target_cpu) if args.role == "draft" else (args.target_cpu, args.draft_cpu)
        )
        other = "target" if args.role == "draft" else "draft"
        alone, loaded = measure(args.role, cpu, other, other_cpu, args.reps)
        print(f"{alone} {loaded}")
        return
    print(f"one-token forward, one thread each, median of {args.reps} (os cpus {len(os.sched_getaffinity(0))})")
    print(f"{'model':<8} {'cpu':>3} {'alone ms':>9} {'other busy ms':>14} {'slowdown':>9}")
    for role, cpu in (("draft", args.draft_cpu), ("target", args.target_cpu)):
        out = subprocess.run(
            [sys.executable, __file__, "--role", role, "--reps", str(args.reps)]
            + ["--draft-cpu", str(args.draft_cpu), "--target-cpu", str(args.target_cpu)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        alone, loaded = float(out[-2]), float(out[-1])
        print(f"{role:<8} {cpu:>3} {alone * 1e3:>9.1f} {loaded * 1e3:>14.1f} {loaded / alone:>8.2f}x")


if __name__ == "__main__":
    main()
