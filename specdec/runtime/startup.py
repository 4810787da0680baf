"""What a model service builds and measures before it serves: a warm-up of the forwards serving
uses (`warm_up`, so the first client's request does not pay for lazy initialisation) and the
batched steps' timings the adaptive policy prices rounds by (`profile_steps`), both on scratch
caches outside any session (`scratch_caches`).

Owns: the warm-up widths and the profiled shapes. Not: the sessions (specdec.runtime.engine), nor
when these run (specdec.serving.lifecycle, bench.costs)."""

from __future__ import annotations

import contextlib
import time

from specdec.limits import SessionLimits

WARM_UP_WIDTHS = (16, 1, 5, 9)  # a short prefill, a draft step, verifies at k = 4 and 8


def warm_up(backend, limits: SessionLimits | None = None) -> None:
    """Build what the backend builds before serving (`prepare(limits)`, optional: a GraphBackend's
    KV cache and CUDA graphs, specdec.runtime.graphs), then run a few forwards of the widths serving uses on
    a scratch cache and free it: the first forward of a process pays for lazy initialisation
    (allocator pools, kernel selection, a growing cache's first allocation), which would otherwise
    land on the first client's request. Call it on the thread that will run the forwards."""
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(limits or SessionLimits())
    with scratch_caches(backend, 1) as [cache]:
        for width in WARM_UP_WIDTHS:
            backend.forward(cache, [i % backend.vocab_size for i in range(width)], 1)


@contextlib.contextmanager
def scratch_caches(backend, n: int):
    """n caches of the backend outside any session, released however the block ends."""
    caches = [backend.new_cache() for _ in range(n)]
    try:
        yield caches
    finally:
        release = getattr(backend, "release", None)
        for cache in caches if release is not None else ():
            release(cache)


PROFILE_SESSIONS = (1, 2, 4, 8, 16)  # the batched decode steps a draft service times at start
# The forwards of one session a target times: a verify of k + 1, and the steps of many sessions' (a
# second thread gains more as a step grows: the fp32 target 1.0x at 1 token, 1.38x at 17, 1.60x at 65)
PROFILE_TOKENS = (1, 2, 3, 5, 9, 17, 33, 65)
PROFILE_CONTEXT = 16  # tokens each profiled session holds
PROFILE_REPS = 3  # timed steps per size (the median), after one dropped


def profile_steps(backend, shapes, cores=None, reps: int = PROFILE_REPS) -> dict[tuple[int, int, int], float]:
    """Median seconds of a batched forward of n sessions each feeding w tokens (and wanting their
    logits: a draft step at w = 1, a verify of w tokens), for each (n, w) in `shapes` and each
    thread count a request may ask for (`cores.counts()`; none: the process's, reported as 0),
    on scratch caches freed afterwards: {(threads, n, w): seconds}; {} for a backend that does
    not batch.

    A draft's step does not grow linearly with the sessions in it (the default Q8_0 draft on
    one core: 8, 25, 34, 40, 88 ms for 1, 2, 4, 8, 16), so a line fitted over the steps a
    service happens to have run extrapolates badly to a load it has not seen yet (fitted over
    steps of 1-4 sessions it priced a step of 8 at 73-77 ms): the adaptive policy prices a
    step by this curve, scaled by what the live steps measure (orchestrator.lookahead), and a
    round on a share of the machine's cores by the curves at that share's threads."""
    batch = getattr(backend, "forward_batch", None)
    if batch is None or not shapes:
        return {}
    counts = cores.counts() if cores is not None else [0]
    with scratch_caches(backend, max(n for n, _ in shapes)) as caches:
        prompt = [(7 + i) % backend.vocab_size for i in range(PROFILE_CONTEXT)]
        batch([(cache, prompt, 1) for cache in caches])
        times: dict[tuple[int, int, int], list[float]] = {(t, n, w): [] for t in counts for n, w in shapes}
        for rep in range(reps + 1):
            for t, n, w in times:  # interleaved: a drift in machine speed hits every size alike
                tokens = [(11 + rep + i) % backend.vocab_size for i in range(w)]
                with cores.step(t, backend) if cores is not None else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    batch([(cache, tokens, w) for cache in caches[:n]])
                    if rep:
                        times[(t, n, w)].append(time.perf_counter() - t0)
                for cache in caches[:n]:
                    backend.crop(cache, PROFILE_CONTEXT)
    return {key: sorted(t)[len(t) // 2] for key, t in times.items()}
