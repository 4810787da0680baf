"""One-process forward costs, each model alone on its service's cores: the overlap bound.

Overlapped rounds can go no faster than the busier of the two devices: per round the draft's
k steps and the target's verify of k + 1 tokens run at once, so a round of `tokens` committed
tokens takes at least max(k draft steps, verify(k + 1)) and
    bound = tokens per round / max(k d, T(k + 1)),
with d and T timed in one process each, alone on the cores its service runs on (a child
process pinned there, the other service's cores idle, the pipeline's services idle too),
with the model the service runs, on a context of the length the bench's generations have.
Sequential rounds' bound is the sum, tokens per round / (k d + T(k + 1)). The bench reports,
per generation, its rounds' tokens/s over the bound its own tokens and drafts per round give.

    python -m bench.costs --widths 1,5,9 \
        --config '{"role": "target", "spec": {"model": "smollm2-135m", "dtype": "float32"}, "cpus": [1], "threads": 1}'
    # one JSON line: {"1": seconds, "5": ..., "9": ...}

Knows nothing of RPC: it builds the backends the services build (deploy.hosting).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

from deploy.configs import ModelServiceConfig
from specdec.runtime import placement
from specdec.runtime.startup import scratch_caches, warm_up
from specdec.weights import models

REPS = 15  # timed forwards per width (median), after two dropped


def forward_costs(backend, widths, context: int, reps: int = REPS) -> dict[int, float]:
    """Median seconds of a forward feeding `width` new tokens after `context` cached ones,
    wanting the logits of all of them (a verify; width 1: a draft step), per width."""
    ids = [(100 + i) % backend.vocab_size for i in range(context + max(widths))]
    with scratch_caches(backend, 1) as [cache]:
        chunk = getattr(backend, "prefill_chunk", None) or context  # llama.cpp takes a prompt in chunks
        for start in range(0, context, chunk):
            backend.forward(cache, ids[start : min(context, start + chunk)], 1)
        times: dict[int, list[float]] = {w: [] for w in widths}
        for rep in range(reps + 2):
            for width in widths:  # interleaved: a drift in machine speed hits every width alike
                t0 = time.perf_counter()
                backend.forward(cache, ids[context : context + width], width)
                if rep >= 2:
                    times[width].append(time.perf_counter() - t0)
                backend.crop(cache, context)
    return {w: statistics.median(t) for w, t in times.items()}


def _backend(config: ModelServiceConfig):
    from deploy.hosting import target_backend
    from draft_service import drafters

    if config.role == "draft":
        return drafters.make(config.drafter, config.spec, config.compile, config.limits)[0]
    return target_backend(config)


def measure(config: ModelServiceConfig, widths, context: int) -> dict[int, float]:
    """forward_costs of the config's model in a child process pinned as the config says."""
    command = [sys.executable, "-m", "bench.costs", "--config", json.dumps(_encode(config))]
    command += ["--widths", ",".join(map(str, widths)), "--context", str(context)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return {int(w): s for w, s in json.loads(out.strip().splitlines()[-1]).items()}


def verify_cost(costs: dict[int, float], width: float) -> float:
    """T(width), interpolated linearly between the measured widths (a fractional mean k)."""
    points = sorted(costs.items())
    for (w0, t0), (w1, t1) in zip(points, points[1:], strict=False):
        if width <= w1:
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
    (w0, t0), (w1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (width - w1) / (w1 - w0)


def overlap_bound(tokens_per_round: float, k: float, draft_step: float, verify: dict[int, float]) -> float:
    """Tokens per second overlapped rounds could reach at most (module docstring)."""
    return tokens_per_round / max(k * draft_step, verify_cost(verify, k + 1))


def sequential_bound(tokens_per_round: float, k: float, draft_step: float, verify: dict[int, float]) -> float:
    """The same for sequential rounds: the draft's k steps, then the verify."""
    return tokens_per_round / (k * draft_step + verify_cost(verify, k + 1))


def _encode(config: ModelServiceConfig) -> dict:
    fields = asdict(config)
    del fields["limits"]  # no sessions here
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a ModelServiceConfig as JSON (its role, model, placement)")
    parser.add_argument("--widths", default="1", help="comma list of tokens fed per forward")
    parser.add_argument("--context", type=int, default=80, help="cached tokens before the timed forwards")
    args = parser.parse_args()
    fields = json.loads(args.config)
    fields["spec"] = models.ModelSpec(**fields["spec"])
    fields["cpus"] = tuple(fields["cpus"]) if fields["cpus"] else None
    config = ModelServiceConfig(**fields)
    placement.apply(config.cpus, config.threads)
    widths = [int(w) for w in args.widths.split(",")]
    backend = _backend(config)
    warm_up(backend)  # what a service does before it serves (a GraphBackend captures its graphs)
    print(json.dumps(forward_costs(backend, widths, args.context)))


if __name__ == "__main__":
    main()
