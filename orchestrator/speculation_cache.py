"""The speculation cache: the next round's drafts prepared for the likeliest rejections.

An overlapped round already prepares the next round for one outcome of its verify: every draft
accepted (the continuation, orchestrator.loop). When the target instead rejects the draft at
position j, its own token t there is committed after the j accepted drafts, and the next round
used to wait for a fresh proposal after them: k draft steps before its verify could start. Where
the draft has time left while the target verifies (the draft's continuation shorter than the
verify plus the link), the cache spends it on proposals for the likeliest such outcomes (j, t),
t taken to be the draft's runner-up at j (the SSD idea: Kumar et al. 2026, "Speculative
Speculative Decoding"; SGLang's enumeration buffer, sglang#31238). A round whose outcome was
prepared (a hit) starts its verify at once.

The rule and its draws are unchanged: a hit only changes where the next round's drafts came from,
and with greedy decoding or the invariant rule the output never depends on the drafts (a draft is
accepted iff it is the target's own token). So the cache serves those rounds only (a Leviathan
round's next drafts are drawn with that round's own uniforms, and its rows kept for the residual).

Which outcomes: the chance that the first rejection is at j is the chance the drafts before it
were accepted times the chance it was not, each read from the acceptance measured for drafts of
that probability (the draft's probability of its own token, in PROBABILITY_BUCKETS); the chance
that the target's token there is the runner-up is measured the same way. How many: as many as
the draft's measured time to spare holds (each a proposal of k steps), at most MAX_BRANCHES, and
only while a branch is worth its cost, in draft steps: a hit spares the k steps of a fresh
proposal; a branch cancelled mid-step delays the next request by up to a step; and the first one
overwrites the draft cache's tail, so that when every draft is accepted after all (the likeliest
outcome) the next continuation feeds the continuation's tokens again (REFEED_STEPS). Before
anything is measured, the prior rates.

Pure: no RPC, no clock. The loop issues the branches and reports each round's outcome.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

PROBABILITY_BUCKETS = 5  # the draft's probability of its token, in [b/5, (b+1)/5)
MAX_BRANCHES = 3  # proposals prepared beside a continuation, at most
# A continuation's k + 1 tokens fed again in one forward cost about this many one-token steps (a
# 9-token forward is 1.5-2.2x a step on a CPU: DESIGN-NOTES' costs).
REFEED_STEPS = 2.0
PRIOR = (1.0, 2.0)  # (hits, trials) every rate starts from: 0.5
SPARE_DECAY = 0.8  # the weight of the past in the draft's measured time to spare


def bucket(p: float) -> int:
    return min(PROBABILITY_BUCKETS - 1, max(0, int(p * PROBABILITY_BUCKETS)))


@dataclass(frozen=True)
class Branch:
    """A rejection prepared for: `accepted` drafts accepted, then `token` (the target's, guessed)."""

    accepted: int
    token: int
    chance: float  # of being the round's outcome


@dataclass
class CacheRates:
    """What the pair's rounds measured: how often a draft of each probability bucket is accepted,
    and how often the target's token at a rejection is the draft's runner-up there."""

    accepted: list[list[float]] = field(default_factory=lambda: [list(PRIOR) for _ in range(PROBABILITY_BUCKETS)])
    runner_up: list[list[float]] = field(default_factory=lambda: [list(PRIOR) for _ in range(PROBABILITY_BUCKETS)])
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def accept(self, p: float) -> float:
        hits, trials = self.accepted[bucket(p)]
        return hits / trials

    def guess(self, p: float) -> float:
        hits, trials = self.runner_up[bucket(p)]
        return hits / trials

    def update(self, top_probs: list[float], runner_ups: list[int], accepted: int, target_token: int) -> None:
        """A round's outcome: its drafts' probabilities, the runner-ups, how many were accepted, and
        the target's token after them (at the rejection, if any)."""
        with self._lock:
            for j, p in enumerate(top_probs[: accepted + 1]):
                self.accepted[bucket(p)][0] += j < accepted
                self.accepted[bucket(p)][1] += 1
            if accepted < len(top_probs):
                rate = self.runner_up[bucket(top_probs[accepted])]
                rate[0] += runner_ups[accepted] == target_token
                rate[1] += 1


def branches(top_probs: list[float], runner_ups: list[int], rates: CacheRates, fanout: int, steps: int) -> list[Branch]:
    """At most `fanout` of the likeliest rejections of a chain whose drafts had `top_probs` (the
    draft's probability of each) and `runner_ups`, likeliest first, each worth its cost (module
    doc) for proposals of `steps` steps."""
    survive, candidates = 1.0, []
    for j, (p, second) in enumerate(zip(top_probs, runner_ups, strict=True)):
        accept = rates.accept(p)
        candidates.append(Branch(j, second, survive * (1 - accept) * rates.guess(p)))
        survive *= accept
    chosen: list[Branch] = []
    for branch in sorted(candidates, key=lambda b: -b.chance)[:fanout]:
        cost = (1 - branch.chance) + (0.0 if chosen else survive * REFEED_STEPS)
        if branch.chance * steps <= cost:
            break
        chosen.append(branch)
    return chosen


@dataclass
class Spare:
    """A generation's measure of the draft's time to spare in an overlapped round: what the round
    waited on the target beyond the draft's continuation, against what a draft step costs."""

    seconds: float | None = None  # time to spare a round (a running mean)
    step: float | None = None  # seconds of one draft step (likewise)

    def update(self, verify_wait: float, continuation: float, steps: int) -> None:
        spare, step = max(0.0, verify_wait - continuation), continuation / max(steps, 1)
        if self.seconds is None:
            self.seconds, self.step = spare, step
            return
        self.seconds = SPARE_DECAY * self.seconds + (1 - SPARE_DECAY) * spare
        self.step = SPARE_DECAY * self.step + (1 - SPARE_DECAY) * step

    def fanout(self, k: int) -> int:
        """How many proposals of k steps to prepare: those the time to spare holds, and one more it
        gets under way (when a hit finds it unfinished, what is left of it is still less than a
        proposal started then); none without a step's time to spare; one before it is measured."""
        if self.seconds is None or not self.step:
            return 1
        if self.seconds < self.step:
            return 0
        return min(MAX_BRANCHES, int(self.seconds // (k * self.step)) + 1)
