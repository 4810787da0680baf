"""Where a round's time goes, in one process: the cost of each forward the loop makes.

    python scripts/cost_model.py [--reps 15] [--context 80] [--threads N]

For the default pair (the fp32 target, the bf16 draft; with llama.cpp installed, also the
Q8_0 GGUF draft and the F32 GGUF target on llama.cpp) it times, on a cached context, a forward
of n = 1, 3, 5, 9 new tokens (the target verifies k + 1 = n tokens; a draft proposes one token
per forward), interleaving the backends rep by rep so a drift in machine speed hits all alike,
and prints medians. Then, for k = 2, 4, 8, the
speedup the formula of Leviathan et al. predicts from one-token costs (c = draft / target)
next to the one these measured costs predict, where verifying k + 1 tokens costs what it was
measured to cost: (k + 1) * target(1) / (k * draft(1) + target(k + 1)) at full acceptance.
Last, a torch profile of one target forward: the share of the matrix products and of the
output layer (vocab x hidden) among the operators.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.runtime import placement
from specdec.runtime.backend import HFBackend
from specdec.weights import models

SIZES = (1, 3, 5, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15, help="timed forwards per backend and size (median)")
    parser.add_argument("--context", type=int, default=80, help="cached tokens before the timed forwards")
    parser.add_argument("--threads", type=int, help="threads of every backend (default: one per usable core)")
    args = parser.parse_args()
    placement.apply(None, args.threads)

    backends = {"target fp32": HFBackend(models.ModelSpec(dtype="float32"))}
    backends["draft bf16"] = HFBackend(models.ModelSpec(dtype="bfloat16"))
    try:
        from specdec.runtime.llamacpp import LlamaCppBackend

        backends["target llama.cpp F32"] = LlamaCppBackend(models.ModelSpec(), models.f32_gguf_path)
        backends["draft llama.cpp Q8_0"] = LlamaCppBackend(models.ModelSpec())
    except RuntimeError as err:
        print(f"(no llama.cpp: {err})")
    context = [100 + i % 1000 for i in range(args.context)]
    times: dict[tuple[str, int], list[float]] = {}
    caches = {}
    for name, backend in backends.items():
        caches[name] = backend.new_cache()
        backend.forward(caches[name], context, 1)
    sizes = {name: (SIZES if name.startswith("target") else (1,)) for name in backends}
    for rep in range(args.reps + 2):  # two warm-up reps, dropped
        for name, backend in backends.items():
            for n in sizes[name]:
                new = [200 + i for i in range(n)]
                t0 = time.perf_counter()
                backend.forward(caches[name], new, n)  # a verify wants the logits of all n
                elapsed = time.perf_counter() - t0
                backend.crop(caches[name], args.context)
                if rep >= 2:
                    times.setdefault((name, n), []).append(elapsed)
    ms = {key: 1000 * statistics.median(v) for key, v in times.items()}

    print(f"\nforward cost, median of {args.reps}, {placement.threads()} threads, context {args.context}:")
    t1 = ms[("target fp32", 1)]
    for (name, n), value in ms.items():
        print(f"  {name:22s} {n} token(s): {value:7.1f} ms  ({value / t1:.2f}x target one token)")
    if ("target llama.cpp F32", 1) in ms:
        ratios = ", ".join(f"{n}: {ms[('target llama.cpp F32', n)] / ms[('target fp32', n)]:.2f}x" for n in SIZES)
        print(f"  llama.cpp F32 target / fp32 torch target, by tokens fed: {ratios}")

    print("\npredicted speedup at full acceptance (k + 1 tokens a round):")
    print("  drafter               k  c      formula  with measured verify cost")
    for name in backends:
        if name.startswith("target"):
            continue
        d = ms[(name, 1)]
        for k in (2, 4, 8):
            verify = ms[("target fp32", k + 1)] if ("target fp32", k + 1) in ms else None
            formula = (k + 1) / (k * d / t1 + 1)
            measured = f"{(k + 1) * t1 / (k * d + verify):.2f}x" if verify else "-"
            print(f"  {name:20s} {k:2d}  {d / t1:.3f}  {formula:6.2f}x  {measured}")

    _profile(backends["target fp32"], caches["target fp32"], args.context)


def _profile(backend: HFBackend, cache, context: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    head = backend.model.get_output_embeddings().weight
    for n in (1, 5):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                backend.forward(cache, list(range(200, 200 + n)), n)
                backend.crop(cache, context)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm"))
        x = torch.randn(n, head.shape[1])
        with torch.inference_mode():
            torch.nn.functional.linear(x, head)
            t0 = time.perf_counter()
            for _ in range(5):
                torch.nn.functional.linear(x, head)
            head_ms = 1000 * (time.perf_counter() - t0) / 5
        print(
            f"\ntarget forward of {n} token(s): matrix products {mm / total:.0%} of operator time; "
            f"the output layer {tuple(head.shape)} alone {head_ms:.1f} ms; "
            f"per forward {total / 3 / 1000:.1f} ms of operators"
        )


if __name__ == "__main__":
    main()
