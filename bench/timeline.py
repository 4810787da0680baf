"""Where a round's time goes: when the draft and the target services are busy, round by round,
for sequential and overlapped rounds, drawn as a timeline.

The loop is run here against the bench's running services, through stubs that note when each
call to a service starts and ends (as the orchestrator sees it: service time plus the wire).
A Propose call is the draft busy, a Score call the target busy; the gaps are idle. Nothing
else is instrumented: the same loop, rule and services the orchestrator runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.server import connect
from specdec.decoding.sampling import SamplingParams
from specdec.serving.security import ClientSecurity

BUSY = {"Propose": "draft", "ProposalRow": "draft", "Score": "target"}


@dataclass
class Span:
    side: str  # "draft" or "target"
    start: float  # seconds from the generation's start
    end: float


class _Timed:
    """A stub that notes the span of every Propose, ProposalRow and Score call."""

    def __init__(self, stub, spans: list[Span], origin: list[float]):
        self._stub, self._spans, self._origin = stub, spans, origin

    def __getattr__(self, name):
        method = getattr(self._stub, name)
        if name not in BUSY:
            return method

        def call(request, **kw):
            t0 = time.perf_counter()
            try:
                return method(request, **kw)
            finally:
                self._spans.append(Span(BUSY[name], t0 - self._origin[0], time.perf_counter() - self._origin[0]))

        return call


def record(
    draft_address: str,
    target_address: str,
    prompt_ids: list[int],
    k: int,
    overlap: bool,
    tokens: int,
    temperature=0.0,
    security: ClientSecurity | None = None,
) -> tuple[list[Span], list[float]]:
    """Generate once; (busy spans, round end times), in seconds from the first round's start.
    `security`: how to reach the services (a local pipeline's need its service token)."""
    pair = connect(draft_address, target_address, security=security)
    spans: list[Span] = []
    origin = [0.0]
    draft, target = _Timed(pair.draft, spans, origin), _Timed(pair.target, spans, origin)
    config = LoopConfig(SamplingParams(temperature=temperature), tokens, lookahead=k, seed=1, overlap=overlap)
    loop = SpeculativeLoop(draft, target, prompt_ids, config, costs=pair.costs)  # the services' threads by kind
    loop.policy = None  # the kind of round the timeline names, every round: no price chooses it
    rounds = loop.rounds()
    first = next(rounds)  # opens the sessions (prefill): not part of the timeline
    origin[0] = time.perf_counter()
    spans.clear()
    ends = []
    for step in rounds if not first.finish_reason else ():
        ends.append(time.perf_counter() - origin[0])
        if step.finish_reason:
            break
    rounds.close()
    return spans, ends


def plot(timelines: dict[str, tuple[list[Span], list[float]]], path, rounds: int = 8) -> None:
    """One row pair (draft, target) per timeline, the first `rounds` rounds, ticks at round ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.6 + 1.3 * len(timelines)), squeeze=False)
    for ax, (title, (spans, ends)) in zip(axes[:, 0], timelines.items(), strict=True):
        stop = ends[min(rounds, len(ends)) - 1] if ends else 0.0
        for row, side in enumerate(("draft", "target")):
            bars = [(s.start, s.end - s.start) for s in spans if s.side == side and s.start < stop]
            ax.broken_barh(bars, (row - 0.35, 0.7), color=("tab:green", "tab:orange")[row])
        for end in ends[:rounds]:
            ax.axvline(end, color="gray", linewidth=0.6, linestyle=":")
        busy = {side: _busy(spans, side, stop) for side in BUSY.values()}
        share = ", ".join(f"{side} busy {busy[side] / stop:.0%}" for side in ("draft", "target")) if stop else ""
        ax.set(yticks=[0, 1], yticklabels=["draft", "target"], xlim=(0, stop or 1), xlabel="seconds")
        ax.set_title(f"{title}: {min(rounds, len(ends))} rounds in {stop:.2f} s; {share}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _busy(spans: list[Span], side: str, stop: float) -> float:
    return sum(min(s.end, stop) - s.start for s in spans if s.side == side and s.start < stop)
