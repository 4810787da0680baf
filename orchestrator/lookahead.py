"""Adaptive lookahead: choose k per round from the session's recent acceptance and costs.

Policy. Under the i.i.d. model of Leviathan et al. (2023), with per-token acceptance alpha and
draft/target cost ratio c, a round of lookahead k commits (1 - alpha^(k+1)) / (1 - alpha)
tokens for a cost of (k c + 1) target forwards, so the speedup over target-only decoding is
    S(k) = (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)).
The formula assumes a round costs one target step whatever k; on a CPU verifying k + 1 tokens
costs more than one (an fp32 135M target: 5 tokens 1.7x one token). With the target's round
time T(k) = T1 + b k (b: seconds per extra token scored), a round costs k (c + s) + 1 target
steps, s = b / T1, so the same S applies with c + s in place of c.
Each round picks the k in 1..k_max that maximises S with these estimated from the rounds:
- alpha: accepted / (accepted + rejections), the maximum-likelihood estimate for the
  geometric accept-until-first-reject process (a round that accepted everything contributes
  no rejection), over an exponentially weighted window (~5 steps, see Load), the generation's own
  with the pair's as a prior (the text decides it);
- c: draft seconds per proposed token / T1, likewise weighted;
- T1 and b: a weighted least-squares line through (tokens scored, target compute seconds) of the
  rounds so far (a slow window, ~30 steps: the cost curve is the hardware's). While every
  round in it scored the same number of tokens the slope is unknown; then one round explores
  another k (half the usual one) and the fit has its two points.
The costs are the pair's (PairCosts): every generation on the orchestrator's pair measures
them and starts from them. Before any evidence it uses k_max. The choice of k never changes
the output law (the rule is exact for every k), only the speed. Pure: no clock, no RPC; the
loop feeds it measurements.

Load. The model services batch the forwards of concurrent sessions (specdec.worker), and the
target reports the tokens of the batched forward that scored each round, all sessions'
together (ScoreResponse.step_tokens), and that step's seconds (compute_seconds): the line is
fitted over those, T(m) = T1 + b (m - 1), the cost of a step of m tokens whoever fed them
(alone, m = k + 1 and the line is the one above). What a round waits on the target beyond its
step (the RPC; under load, the step in progress when it arrives) is measured apart, for rounds
that speculated (w_on) and rounds that did not (w_off): sessions decoding without speculation
come back together and share every step, while speculating ones come back from the draft at
different times and queue behind others' steps. (Fitted into the line, as before, the
queueing made every step look dear and speculation cheap by comparison.) A wait is counted up
to two steps' compute: longer is a transient (behind the prefills of a wave of new prompts,
seconds) that says nothing of the rounds to come. Every generation reports its rounds, so the
windows count steps, not reports: a round of each of N generations weighs as one step (counted
one by one, under load the line's window shrank to two steps and its intercept swung from 12
to 234 ms between rounds). With N generations
running (`load`, those of this process) the policy prices speculation against everyone
decoding without it: N one-token rounds are a step of T(N), a round t0 = T(N) + w_off. The N
generations' speculating rounds interleave: while some draft, others are verified, so a round
of them all costs the busier device's work, not the sum: the draft's k steps of all N, k d(N),
or the target's verify of N blocks of k + 1, T(N) + w_on + N b k. So
S(k) = E[tokens] t0 / max(k d(N), T(N) + w_on + N b k). (Priced as the sum, as if every
generation drafted and then verified in lockstep, speculation at 8 clients looked 1.3x dearer
than decoding without it, where sequential k = 4 measured 1.1-1.25x faster than it.) Under load
the rounds are sequential, not overlapped (`overlapping`): the other generations' rounds
already fill each device, and a continuation that a rejection throws away costs the draft,
which sets the pace (measured at 8 clients: sequential k = 4 1.12x overlapped). d(N) is the
draft's seconds per token when the N generations draft together, as they all choose alike: the
draft reports the steps that ran each proposal and their tokens, all sessions'
(ProposeResponse.steps, step_tokens), and its step's compute is fitted over them as the target's
is, D(m) = D1 + e (m - 1); d(N) is D(N) a token, plus what a round waits for the draft beyond
its compute (up to two of its computes, as for the target: a proposal queued behind the draft's
prefills of a wave of new prompts waits seconds, and that wait, uncapped, priced the draft at
100 ms a token for minutes after a burst of 16 clients, its step at 2 being 31 ms). A draft that
batches nothing (the llama.cpp Q4_1 draft on one core: 13, 26, 38, 85, 164 ms a step for 1, 2,
4, 8, 16 sessions) costs a round drafting alone one session's step, and N generations drafting
together N each: priced at its mean cost, measured mostly by lone explorations while speculation
was off, speculation looked cheap, every generation took it up, the draft's cost rose N-fold,
and k swung between 0 and k_max. Under load (N > 1) speculation is taken only when its best k
promises 1 + MARGIN: near the break-even the model's error (~10%) decides, and switching costs
(sessions that speculate come back out of step with the others).
k = 0 (no speculation: the round is one target step) is a choice too, S(0) = 1, taken when no
k pays; rounds at k = 0 keep the fit fresh, and after EXPLORE_EVERY steps off (rounds of the
pair's generations, counted as above) one round explores k = 2, so acceptance and costs are
measured again when the load falls. An exploration that finds speculation still does not pay
doubles the wait before the next (up to EXPLORE_MAX steps): under a steady high load the
explorations' cost falls towards nothing.

Overlapped rounds (orchestrator.loop; one generation on the pair) change the cost: the draft
proposes round r + 1 (k + 1 tokens, d seconds each) while the target verifies round r (T1 + b k
seconds); a round whose
drafts were proposed that way starts at once, which happens when all k drafts and the
continuation's first token are accepted (alpha^(k+1)); otherwise it first waits for k fresh
drafts. Tokens per second in steady state:
    R(k) = E[tokens] / (max(T1 + w_on + b k, (k + 1) d) + (1 - alpha^(k+1)) k d),
with E[tokens] = (1 - alpha^(k+1)) / (1 - alpha) as before. Its best k makes the draft's
continuation end about when the verify does, less where rejections waste the drafting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

DECAY = 0.8  # weight of the past per step (a round of each generation): a window of ~5 steps
FIT_DECAY = 0.97  # the same for the cost lines: ~30 steps
MIN_SPREAD = 0.1  # weighted variance of tokens scored below which the slope is unknown
MARGIN = 0.1  # under load, the gain speculation must promise to be taken: the model's error there
EXPLORE_EVERY = 8  # steps without speculation before one round tries it again
EXPLORE_MAX = 128  # the longest wait, after explorations that found speculation does not pay
PRIOR_TRIALS = 2.0  # weight, in draft tokens tested, of the pair's acceptance in a generation's


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens] a round of k drafts commits: (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha 1."""
    return k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def queued(waited: float, compute: float) -> float:
    """What a request waited beyond its compute, counted up to two computes: a request arriving
    during a step waits for it (about as long as its own), no more, while the load holds; a
    longer wait is a transient (behind the prefills of a wave of new prompts: seconds) that
    says nothing of the rounds to come."""
    return min(max(0.0, waited - compute), 2 * compute)


def expected_speedup(alpha: float, k: int, cost_ratio: float, base: float = 1.0) -> float:
    """S(k) above; alpha in [0, 1]; S(0) = 1. `base`: a speculating round's cost at k = 0 over a
    round without speculation (1 unless they wait differently for the target, see Load)."""
    if k == 0:
        return 1.0
    tokens = expected_tokens(alpha, k)
    return tokens / (k * cost_ratio + base)


def best_lookahead(alpha: float, cost_ratio: float, k_max: int, base: float = 1.0) -> int:
    """The k in 0..k_max with the highest S (0: no speculation pays)."""
    return max(range(0, k_max + 1), key=lambda k: expected_speedup(alpha, k, cost_ratio, base))


def speculates(gain: float, speculating: bool | None) -> bool:
    """Under load: whether to speculate, given the best k's expected gain and whether the rounds
    speculate now (None: no decision yet, taken when it gains); taken above 1 + MARGIN, dropped
    below 1 - MARGIN, kept in between."""
    if speculating is None:
        return gain > 1
    return gain >= (1 - MARGIN if speculating else 1 + MARGIN)


def pipelined_speedup(alpha: float, k: int, draft: float, verify: float, slope: float, t0: float) -> float:
    """Under load: sequential rounds of lookahead k, all N generations' interleaved, over rounds
    without speculation (t0 seconds a token). Per round of them all the draft computes k steps
    of all N (draft: seconds a token at N) and the target verifies N blocks of k + 1 (verify +
    slope k): one device's work goes on while the other's does, so the busier one sets the pace."""
    if k == 0:
        return 1.0
    tokens = expected_tokens(alpha, k)
    return tokens * t0 / max(k * draft, verify + slope * k)


def best_pipelined_lookahead(alpha: float, draft: float, verify: float, slope: float, t0: float, k_max: int) -> int:
    return max(range(0, k_max + 1), key=lambda k: pipelined_speedup(alpha, k, draft, verify, slope, t0))


def overlapped_rate(alpha: float, k: int, draft: float, t1: float, slope: float) -> float:
    """R(k) above: tokens per second of overlapped rounds; draft, t1, slope in seconds."""
    tokens = expected_tokens(alpha, k)
    carried = alpha ** (k + 1)
    return tokens / (max(t1 + slope * k, (k + 1) * draft) + (1 - carried) * k * draft)


def best_overlapped_lookahead(alpha: float, draft: float, t1: float, slope: float, k_max: int) -> int:
    return max(range(1, k_max + 1), key=lambda k: overlapped_rate(alpha, k, draft, t1, slope))


@dataclass
class DraftCost:
    """What a round waited for the draft: `seconds` for `tokens` proposed; of which the service
    reported `compute` seconds in `steps` batched forwards of `step_tokens` tokens in all (all
    sessions'; steps 0: not reported, or a model-free drafter)."""

    seconds: float
    tokens: int
    compute: float = 0.0
    steps: int = 0
    step_tokens: int = 0


class CostLine:
    """A weighted least-squares line y = y1 + slope (x - 1) through (x, y) points, older points
    weighted down by FIT_DECAY per step: a cost per step over the tokens in the step."""

    def __init__(self):
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float, share: float = 1.0) -> None:
        """A point; `share`: the part of one step it stands for (older points decay by that)."""
        f = FIT_DECAY**share
        self.w = f * self.w + 1
        self.x = f * self.x + x
        self.y = f * self.y + y
        self.xx = f * self.xx + x * x
        self.xy = f * self.xy + x * y

    def mean(self) -> float:
        return self.y / self.w

    def fit(self) -> tuple[float, float] | None:
        """(y1, slope), the slope at least 0 (the mean and 0 where the line would cost nothing
        at x = 1); None while the points do not spread over enough x to fit a slope."""
        if self.w == 0:
            return None
        mean_x, mean_y = self.x / self.w, self.y / self.w
        spread = self.xx / self.w - mean_x**2
        if spread < MIN_SPREAD:
            return None
        slope = max(0.0, (self.xy / self.w - mean_x * mean_y) / spread)
        y1 = mean_y - slope * (mean_x - 1)
        return (y1, slope) if y1 > 0 else (mean_y, 0.0)


class PairCosts:
    """What the rounds of every generation on one draft/target pair measure: the target's verify
    cost line, the waits, the draft's cost line, the acceptance, and how long speculation
    has been off. One per orchestrator (generation.ModelPair), shared by its generations, as
    vLLM's dynamic speculative decoding keeps its statistics per engine and not per request: a new
    generation starts from what the others measured instead of from k_max with no evidence (a
    short generation under load used to spend most of its rounds learning), and under a steady
    load where speculation does not pay the explorations are paid once for all generations, not
    once by each. Updated and read under its lock (generations run on their own threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.accepted = 0.0  # all generations' rounds, weighted by DECAY
        self.rejections = 0.0
        # the draft: seconds waited for it, of which its service computed, its steps, the tokens
        # it proposed (DECAY); and its step's compute over the tokens in the step (all sessions')
        self.draft_seconds = 0.0
        self.draft_compute = 0.0
        self.draft_steps = 0.0
        self.draft_tokens = 0.0
        self.draft_line = CostLine()
        # the target's step compute over the step's tokens, all sessions' together
        self.verify = CostLine()
        self.usual_k = 0.0  # drafts proposed a round, weighted like the verify line
        # seconds a round waited on the target beyond its step's compute (the RPC, and queueing
        # behind a step in progress), weighted by DECAY: [sum, weight] for rounds that
        # speculated (k > 0) and rounds that did not
        self.waits = {True: [0.0, 0.0], False: [0.0, 0.0]}
        self.off_rounds = 0.0  # steps in a row (rounds of all generations, see update) without speculation
        self.explore_after = EXPLORE_EVERY  # steps off before the next exploration

    def verify_cost(self, k_max: int) -> tuple[float, float] | None:
        """(T1, b): target seconds for a step of one token and per extra token in the step;
        None while the steps do not spread over enough sizes to fit a slope."""
        line = self.verify.fit()
        return (self.verify.mean(), 0.0) if line is None and k_max <= 1 else line

    def draft_cost(self, sessions: int) -> float:
        """Seconds a drafted token costs when `sessions` draft together: the draft's step for
        that many (its line; a llama.cpp draft on one core batches almost nothing, a step of
        16 sessions costs 12 of one) per token, plus what a round waits for the draft beyond its
        compute. The mean measured cost while the line is unknown (the steps all the same size,
        or a service that does not report them)."""
        line = self.draft_line.fit()
        if line is None or self.draft_steps == 0:
            return self.draft_seconds / self.draft_tokens
        d1, slope = line
        step = d1 + slope * (sessions - 1)
        waited = max(0.0, self.draft_seconds - self.draft_compute)
        return (step * self.draft_steps + waited) / self.draft_tokens

    def wait(self, speculating: bool) -> float:
        """Seconds a round waits on the target beyond its step's compute, speculating or not;
        one mode not measured lately: the other's."""
        total, weight = self.waits[speculating]
        if weight < 0.5:
            total, weight = self.waits[not speculating]
        return total / weight if weight else 0.0

    def update(
        self,
        proposed: int,
        accepted: int,
        draft: DraftCost,
        target_seconds: float,
        step: int,
        target_compute: float,
        sessions: int = 1,
    ) -> None:
        """One round of one of `sessions` generations running: each reports its rounds, so the
        windows above count rounds of them all (a round of each of 16 generations is one step,
        not 16: counted one by one, the line's window shrank to two steps under load and its
        intercept swung from 12 to 234 ms)."""
        share = 1 / max(1, sessions)
        d = DECAY**share
        for mode, waited in self.waits.items():
            waited[0] *= d
            waited[1] *= d
            if mode == (proposed > 0):
                waited[0] += queued(target_seconds, target_compute)
                waited[1] += 1
        self.accepted = d * self.accepted + accepted
        self.rejections = d * self.rejections + (1 if accepted < proposed else 0)
        if draft.tokens:
            # its queueing capped as the target's is (steps 0: no compute reported, all of it counts)
            seconds = draft.compute + queued(draft.seconds, draft.compute) if draft.steps else draft.seconds
            self.draft_seconds = d * self.draft_seconds + seconds
            self.draft_compute = d * self.draft_compute + (draft.compute if draft.steps else 0.0)
            self.draft_steps = d * self.draft_steps + draft.steps
            self.draft_tokens = d * self.draft_tokens + draft.tokens
            if draft.steps:
                self.draft_line.add(draft.step_tokens / draft.steps, draft.compute / draft.steps, share)
        self.usual_k = FIT_DECAY**share * self.usual_k + proposed
        self.verify.add(step, target_compute, share)


@dataclass
class AdaptiveLookahead:
    """One generation's policy over its pair's shared costs (a private PairCosts when none is
    given). Acceptance is the generation's own (its text), with the pair's as a prior of
    PRIOR_TRIALS trials: alone on a pair, the estimate is exactly its own."""

    k_max: int
    overlap: bool = False  # rounds are overlapped: maximise R(k) instead of S(k) (one generation)
    load: Callable[[], int] = lambda: 1  # generations sharing the services' forwards
    costs: PairCosts = field(default_factory=PairCosts)
    accepted: float = 0.0
    rejections: float = 0.0
    speculating: bool | None = None  # under load: the side of the MARGIN band it is on (see Load)
    overlapping: bool = True  # with `overlap`: whether its last choice overlaps the rounds (see Overlapped rounds)

    def next_k(self) -> int:
        """The k for the next round (called once a round: it counts the steps off)."""
        with self.costs.lock:
            costs = self.costs
            k = self._best_k()
            if k > 0:
                costs.off_rounds, costs.explore_after = 0, EXPLORE_EVERY
                return k
            costs.off_rounds += 1 / max(1, self.load())  # counted in steps: a round of each generation is one
            if costs.off_rounds < costs.explore_after:
                return 0
            costs.off_rounds, costs.explore_after = 0, min(2 * costs.explore_after, EXPLORE_MAX)
            return min(2, self.k_max)

    def alpha(self) -> float | None:
        """Per-token acceptance: this generation's, the pair's as a prior; None: no evidence."""
        shared = self.costs.accepted + self.costs.rejections
        if shared == 0:
            return None
        prior = self.costs.accepted / shared
        return (self.accepted + PRIOR_TRIALS * prior) / (self.accepted + self.rejections + PRIOR_TRIALS)

    def _best_k(self) -> int:
        costs = self.costs
        alpha = self.alpha()
        if costs.verify.w == 0 or alpha is None or costs.draft_tokens == 0:
            return self.k_max
        line = costs.verify_cost(self.k_max)
        if line is None:  # every recent step fed the same number of tokens: try another k
            usual = round(costs.usual_k / costs.verify.w)
            if usual == 0:  # rounds have been off: next_k's explorations (backing off) probe k = 2
                return 0
            return usual // 2 if usual >= 2 else min(self.k_max, usual + 2)
        t1, slope = line
        waits = costs.wait(True), min(costs.wait(False), costs.wait(True))  # see Load: w_off <= w_on
        n = max(1, self.load())
        draft = costs.draft_cost(n)  # every generation drafting, as they all choose alike
        if n == 1:
            self.overlapping = self.overlap
            if self.overlap:
                return best_overlapped_lookahead(alpha, draft, t1 + waits[0], slope, self.k_max)
            ratio, base = (draft + slope) / (t1 + waits[1]), (t1 + waits[0]) / (t1 + waits[1])
            return best_lookahead(alpha, ratio, self.k_max, base)
        # Under load: sequential rounds, pipelined across the generations (see Load).
        self.overlapping = False
        step = t1 + (n - 1) * slope  # the step of n one-token rounds
        t0 = step + waits[1]  # a round without speculation
        verify = step + waits[0]  # the verify of n one-token blocks, speculating
        k = best_pipelined_lookahead(alpha, draft, verify, n * slope, t0, self.k_max)
        self.speculating = speculates(pipelined_speedup(alpha, k, draft, verify, n * slope, t0), self.speculating)
        return k if self.speculating else 0

    def update(
        self,
        proposed: int,
        accepted: int,
        draft: DraftCost | float,
        target_seconds: float,
        step_tokens: int | None = None,
        target_compute: float | None = None,
    ) -> None:
        """One round: drafts verified and accepted, what it waited for the draft (seconds alone:
        for the proposed tokens, the service's steps unknown), the seconds waited on the target,
        of which `target_compute` its step's (as the target reports; default: all), and the
        tokens of the target's batched forward that scored them (default: this round's alone,
        proposed + 1, as when no other session shares the target)."""
        self.accepted = DECAY * self.accepted + accepted
        self.rejections = DECAY * self.rejections + (1 if accepted < proposed else 0)
        if not isinstance(draft, DraftCost):
            draft = DraftCost(draft, proposed)
        step = proposed + 1 if step_tokens is None else step_tokens
        with self.costs.lock:
            compute = target_seconds if target_compute is None else target_compute
            self.costs.update(proposed, accepted, draft, target_seconds, step, compute, self.load())
