"""Adaptive lookahead: choose k per round from the recent acceptance and the measured costs.

Policy. Under the i.i.d. model of Leviathan et al. (2023), with per-token acceptance alpha, a
round of k drafts commits E[tokens] = (1 - alpha^(k+1)) / (1 - alpha) tokens. Each round picks
the k in 0..k_max (0: no speculation) and, where overlapped rounds are allowed, the kind of
round that maximise E[tokens] t0 / round_time(k), t0 being what a token costs without
speculation. The estimates, from the rounds:
- alpha: accepted / (accepted + rejections), the maximum-likelihood estimate for the
  geometric accept-until-first-reject process (a round that accepted everything contributes
  no rejection), over an exponentially weighted window (~5 steps, see Load), the generation's
  own with the pair's as a prior (the text decides it);
- the target's step, T(m) = T1 + b (m - 1) for a step of m tokens whoever fed them: a weighted
  least-squares line through (the step's tokens, its compute) as the target reports them
  (ScoreResponse.step_tokens, compute_seconds) over a slow window (~30 steps: the curve is the
  hardware's). On a CPU b is far from 0 (an fp32 135M target: 5 tokens 1.7x one token), on a
  GPU near it. While every step in the window had the same size the slope is unknown; then one
  round explores another k (half the usual one) and the fit has its two points;
- the draft's step D(n) for n sessions: the curve its service timed when it started
  (Describe's step_costs, specdec.engine.profile_steps), interpolated, times the ratio of what
  its steps measure in serving (ProposeResponse.steps, step_tokens, compute_seconds) to the
  curve at their sizes: the shape from the profile, the level from serving (1.3-1.5 measured
  at 1-16 clients: the service's handlers share the core). The curve is far from a line (the
  Q8_0 default on one core 8, 25, 34, 40, 88 ms a step for 1, 2, 4, 8, 16 sessions, the Q4_1
  file 10, 21, 34, 57, 115): the line D1 + e (n - 1) fitted over the steps a pair's first
  clients ran (1-4 sessions) priced a step of 8 at 73-77 ms, and adaptive lookahead at 8 clients
  stayed off where k = 4 gave 1.4x. Without a profile (a service that does not report one),
  that line, fitted the same way;
- the waits: what a round waits on the target beyond its step's compute (the RPC; under load,
  the step in progress when it arrives), apart for rounds that speculated (w_on) and rounds that
  did not (w_off), and what it waits for the draft beyond its compute, each counted up to two
  computes: longer is a transient (behind the prefills of a wave of new prompts, seconds) that
  says nothing of the rounds to come (uncapped, it priced the draft at 100 ms a token for
  minutes after a burst of 16 clients, its step at 2 being 31 ms).
The costs are the pair's (PairCosts): every generation on the orchestrator's pair measures
them and starts from them. Before any evidence it uses k_max. The choice of k never changes
the output law (the rule is exact for every k), only the speed. Pure: no clock, no RPC; the
loop feeds it measurements.

Pricing (round_time). With N generations running (`load`, those of this process), all drafting
alike, a draft step costs d = D(N) and a round of one generation takes the longest of
- its own path: overlapped, its verify beside the continuation's k + 1 draft steps, and after
  a rejection (1 - alpha^(k+1) of the rounds) k fresh steps before the next verify:
  max(T_v + w_on, (k + 1) d) + (1 - alpha^(k+1)) k d; sequential, k d + T_v + w_on;
- the target's work for a round of all N: N / s verify steps of s blocks of k + 1 tokens,
  T_v = T(s (k + 1)) each, s the generations whose blocks share a step;
- the draft's work for it: (k + 1) d + (1 - alpha^(k + 1)) k d overlapped, k d sequential.
Without speculation a round is a step of the N one-token rounds: t0 = T(N) + w_off. Alone (N = 1,
s = 1) the path is the longest and the price is the one-generation formula; with T flat it is
Leviathan's S(k) = E[tokens] / (k c + 1), c = d / T1. Under load a device's work can be the
longest, and s decides the target's: sessions decoding without speculation come back together
and share every step (the worker's gather window), speculating ones come back from the draft at
different times. Priced in lockstep (s = N), speculation at 16 clients promised 1.5x where it
measured 0.7-0.8x: the target's steps held 2-3 of the 16 sessions, each paying the step's fixed
cost (T1 ~ 100 ms against b ~ 5 ms a token on one core). So s is measured: the target reports
the sessions of the step that scored each round (ScoreResponse.step_sessions), and the share of
the load they are in speculating rounds is kept (explorations left out: a lone speculating round
rides in everyone's step); until measured, s = N. Overlapped rounds cost the draft more work,
sequential ones a longer path; under load the choice is the price's (measured at 8 clients,
after the continuation stopped re-feeding its tail: overlapped k = 4 47.0 tok/s against
sequential 41.4, k = 2 46.9 against 36.2).

Calibration. Under load the price misses what no term of it holds. Measured on 2 cores over
whole waves of clients it promised 1.4-1.6x at 8 where speculation gave 0.93-0.98x, and 1.2-1.45x
at 16 where it gave 0.7-0.8x. Over quiet rounds only (below), a speculating round at 8 clients
took 0.9-1.4 of its price and at 16 took 1.5-2.2 of it (the draft's step of 16 sessions was
priced from its line over smaller steps, 120-128 ms, and measured 383 ms with its queueing),
while a plain round took 0.8-1.5 of its price at every load. No term extrapolates from 8 to 16.
So every quiet round (explorations left out) compares its time, from its generation's last
commit to its own, with the price of its kind of round, and the pair keeps the ratio apart for
speculating and plain rounds and for each load (1, 2, 3-4, 5-8, 9-16, ...). Under load the gain
is corrected by the plain rounds' ratio (1 until measured at that load: their price is the
verify line, measured at every load) over the speculating rounds'. Where speculating rounds
have not been measured at a load, the formula must promise 1 + UNPROVEN to be taken: its error
there is unknown, and only measuring speculation there tells it (a wave of 16 clients that
opened 16 drafts on the formula's 1.2x spent most of its 11 s learning that it paid 0.7x).
Only the drafts the policy chose are compared with a price (an exploration's continuation,
carried into the next round, is not: one such round at 0.67 of a price set the correction at 16
clients and sent all 16 speculating), and a load's correction needs a step's worth of rounds (a
round of each generation). Quiet: no prompt was prefilled on the pair (an OpenSession in flight
on either service, or a Propose carrying a draft's catch-up of commits made without it) between
the round's start and its commit. A round behind a prefill waits seconds that say nothing of the
rounds to come, and neither its time nor its wait on the target is counted (counted, the plain
rounds at the start of a wave rose to the cap, a correction favoured speculation exactly when
it paid least, 41.8 tok/s at 8 clients where the formula alone gave 53.3; and their waits priced
a plain round at 16 clients at twice its step, 272-345 ms, so that speculation promised 1.6-2.2x).
A round counts up to MISPRICED times its price, and each ratio decays with its own rounds only:
it stays while the load is elsewhere. Alone the price is the formula's, as measured (overlapped
rounds within 2-5% of its bound).

Measured. Calibrated, the price still missed under load on shared cores: at 8 clients quiet
speculating rounds took 1.32x their price and plain ones 1.26x, so it promised 1.43-1.55x where
speculation ran 0.87-0.98x speculation off (the model's error, ~25%, beyond the MARGIN). Nor do
a generation's rounds tell it: timed from its last commit, speculating rounds committed 10-12
tokens a second a generation and plain ones 7 where whole runs gave 9 and 12, because a round
leaves out the prompts' prefills (a speculating generation opens its draft's session too, on the
cores the target uses) and a plain round among speculating ones rides in their steps. What the
pair commits a second says it. So under load the pair's rounds run in one regime, speculating or
not, and the pair keeps each regime's rate per load class: the tokens every round committed over
the time between the pair's commits (times the load: a generation's rate), over the last
RATE_WINDOW seconds of the regime's latest run, counted once every generation has had a round in
it (a switch's first step is the switch's) and not across IDLE seconds without a commit. The
rates veto, they do not explore: where the price chooses plain rounds they run (speculation forced
on 16 clients to measure it, every session opening its draft, cost more than the measurement
could win: 0.5-0.7x speculation off); where it chooses speculation, speculation runs MEASURED
seconds at that load, then plain rounds do, then the faster is taken, and the slower runs again
for MEASURED seconds after REVISIT seconds, after twice as long each time it is found slower
still (up to REVISIT_MAX): the two are compared after each revisit, not continuously (a prefill
burst's dip in the regime in force, set against the other's older rate, switched it for nothing).
Which k speculation takes stays the price's.

Cores. Where the draft and the target share one machine's cores (PairCosts.sharing, from the
services' Describe: specdec.placement), the two kinds of round are two placements: an overlapped
round runs both services at once, each on its share of the threads (space-sharing), a
sequential one runs them in turn, each forward on every core (time-sharing: the core lock
keeps the other service off them), so its draft's and target's work add up on the one machine
(RoundCosts.shared) where a pair of devices does each beside the other. That is for one
generation alone: under load one generation's draft steps fall between another's verify steps,
and time-sharing made every step of the machine wait for the lock (2 and 4 clients choosing
sequential rounds on every core: 40-51 tok/s, where k = 4 on the shares gave 42-67), so there any
round that drafts runs on the shares, and both kinds are priced there. Each is priced at its
threads: the draft's step by its service's profile at those threads (scaled by what serving
measures against the profile at the threads its steps ran with), the target's the same way, by
its profile of 1-65 tokens at those threads scaled by what its steps measured (target_step; the
verify line, fitted over steps of a few sizes under load, priced a plain step of 16 on every
core near a speculating one); a plain round runs the target on every core.
A fixed k (not adaptive) is priced too where its text does not depend on the schedule (greedy,
the invariant rule): such a request gets the cheaper kind of round each round (`fixed`).

Load. Every generation reports its rounds, so the windows count steps, not reports: a round of
each of N generations weighs as one step (counted one by one, under load the line's window
shrank to two steps and its intercept swung from 12 to 234 ms between rounds). Under load
(N > 1) the price takes speculation only when its best k promises 1 + MARGIN and drops it below
1 - MARGIN: near the break-even the model's error decides, and each switch costs (sessions that
speculate come back out of step with the others; a dropped continuation); and once both regimes
have run at a load, their measured rates decide (see Measured). k = 0 is a choice too: rounds at
k = 0 keep the fit fresh. Alone, after EXPLORE_EVERY steps off one round explores k = 2, so
acceptance and costs are measured again; one that finds speculation still does not pay doubles
the wait before the next (up to EXPLORE_MAX steps). Under load the regimes' revisits explore in
their place (a lone exploration opened its generation's draft for one round).

Default k. A request that names no lookahead, on a server started without --lookahead, runs a
fixed k that this pricing chooses (measured_lookahead): the k in 1..MEASURED_LOOKAHEAD that the
pair's measured costs and acceptance price fastest for a generation alone, once the pair has
measured them (DEFAULT_LOOKAHEAD, 4, before). Only where its text does not depend on k (greedy,
the invariant rule) and for chains: a Leviathan sample keeps 4 so that its seed replays whatever
ran on the pair before it. Such a generation keeps a fixed policy, so its rounds go on measuring
the pair. Never 0: it was asked to speculate (adaptive lookahead is the choice that may stop).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

DECAY = 0.8  # weight of the past per step (a round of each generation): a window of ~5 steps
FIT_DECAY = 0.97  # the same for the cost lines: ~30 steps
MIN_SPREAD = 0.1  # weighted variance of tokens scored below which the slope is unknown
MARGIN = 0.1  # under load, the gain speculation must promise to be taken: the model's error there
EXPLORE_EVERY = 8  # steps without speculation before one round tries it again
EXPLORE_MAX = 128  # the longest wait, after explorations that found speculation does not pay
PRIOR_TRIALS = 2.0  # weight, in draft tokens tested, of the pair's acceptance in a generation's
MISPRICED = 3.0  # a round's measured/priced ratio counted at most (see Calibration)
CALIBRATED = 1.0  # steps (a round of each generation) a kind of round needs at a load before its ratio counts
UNPROVEN = 0.5  # under load, the gain the formula must promise where speculation is not calibrated
MEASURED = 4.0  # seconds a regime runs at a load for its rate to count (see Measured)
REVISIT = 40.0  # seconds before the regime that measured slower runs again for MEASURED seconds
REVISIT_MAX = 320.0  # the longest wait, after revisits that found it slower still (doubling)
RATE_WINDOW = 10.0  # seconds of a regime's run its rate weighs (older ones decay by e each)
IDLE = 1.0  # seconds without a commit on the pair that are a pause, not a measurement


def load_class(load: int) -> int:
    """The loads calibrated together (see Calibration): 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8..."""
    return max(0, load - 1).bit_length()


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens] a round of k drafts commits: (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha 1."""
    return k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def queued(waited: float, compute: float) -> float:
    """What a request waited beyond its compute, counted up to two computes: a request arriving
    during a step waits for it (about as long as its own), no more, while the load holds; a
    longer wait is a transient (behind the prefills of a wave of new prompts: seconds) that
    says nothing of the rounds to come."""
    return min(max(0.0, waited - compute), 2 * compute)


def speculates(gain: float, speculating: bool | None) -> bool:
    """Under load: whether to speculate, given the best k's expected gain and whether the rounds
    speculate now (None: no decision yet, taken when it gains); taken above 1 + MARGIN, dropped
    below 1 - MARGIN, kept in between."""
    if speculating is None:
        return gain > 1
    return gain >= (1 - MARGIN if speculating else 1 + MARGIN)


def profiled(profile: dict[int, float], sessions: float) -> float:
    """A draft step of `sessions` sessions from its service's profile (step_costs): linear
    between the sizes timed; below the smallest, the smallest's; past the largest, that step's
    cost a session (no batching assumed beyond what was measured)."""
    points = sorted(profile.items())
    if sessions <= points[0][0]:
        return points[0][1]
    for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
        if sessions <= n1:
            return t0 + (t1 - t0) * (sessions - n0) / (n1 - n0)
    n, t = points[-1]
    return t * sessions / n


@dataclass(frozen=True)
class RoundCosts:
    """What a round of one of `load` generations costs, in seconds (see Pricing)."""

    draft: float  # a draft step, with the generations drafting together: D(load)
    verify: tuple[float, float]  # (T1, b): the target's step of m tokens, T1 + b (m - 1)
    wait: float = 0.0  # what a speculating round waits on the target beyond its step
    load: int = 1  # generations running
    sessions: float = 1.0  # of them, those whose blocks share a verify step (measured)
    shared: bool = False  # the two services take turns on one machine's cores: their works add up
    scale: Callable[[float], float] | None = None  # the verify line at the round's threads: T(m) scale(m)
    price: Callable[[float], float] | None = None  # the target's step at the round's threads (in place of both)

    def step(self, tokens: float) -> float:
        if self.price is not None:
            return self.price(tokens)
        t1, slope = self.verify
        line = t1 + slope * (tokens - 1)
        return line * self.scale(tokens) if self.scale is not None else line


def round_time(alpha: float, k: int, costs: RoundCosts, overlap: bool) -> float:
    """Seconds a round of k drafts takes a generation (Pricing): the longest of its own path, the
    target's work and the draft's work for a round of all `load` generations."""
    sessions = min(costs.load, max(1.0, costs.sessions))
    verify = costs.step(sessions * (k + 1))  # the step this round's block rides in
    target_work = costs.load / sessions * verify
    if overlap:  # the continuation's k + 1 steps beside the verify; after a rejection, k fresh ones
        rejected = (1 - alpha ** (k + 1)) * k * costs.draft
        path = max(verify + costs.wait, (k + 1) * costs.draft) + rejected
        draft_work = (k + 1) * costs.draft + rejected
    else:
        path = k * costs.draft + verify + costs.wait
        draft_work = k * costs.draft
    if costs.shared:  # one machine's cores, the services in turn
        return max(path, target_work + draft_work)
    return max(path, target_work, draft_work)


def speedup(alpha: float, k: int, costs: RoundCosts, overlap: bool, t0: float) -> float:
    """E[tokens] of a round of k drafts over its round_time, against t0 seconds a token without
    speculation; 1 at k = 0."""
    return 1.0 if k == 0 else expected_tokens(alpha, k) * t0 / round_time(alpha, k, costs, overlap)


def best_lookahead(
    alpha: float, costs: RoundCosts | Mapping[bool, RoundCosts], t0: float, k_max: int, overlap: bool
) -> tuple[int, bool]:
    """(k, overlapped) with the highest speedup, k in 0..k_max (0: no speculation pays);
    overlapped rounds only where `overlap` allows them; of equals, the smallest k. `costs`: one
    for both kinds of round, or each kind's (overlapped: True), as on cores the services share."""
    by_mode = costs if isinstance(costs, Mapping) else {True: costs, False: costs}
    modes = (True, False) if overlap else (False,)
    best, most = (0, overlap), 1.0
    for k in range(1, k_max + 1):
        for mode in modes:
            gain = speedup(alpha, k, by_mode[mode], mode, t0)
            if gain > most * (1 + 1e-9):
                best, most = (k, mode), gain
    return best


@dataclass(frozen=True)
class Sharing:
    """The draft and the target on one machine's cores (see Cores): the threads each runs with in
    overlapped rounds (its share, both at once) and in sequential ones (every core, in turn), and
    what their forwards cost at each as the services timed them at start (Describe's
    step_costs): the draft's batched step by sessions, the target's forward by tokens."""

    draft_threads: tuple[int, int]  # (overlapped, sequential)
    target_threads: tuple[int, int]
    draft: dict[int, dict[int, float]]  # threads -> {sessions: seconds}
    verify: dict[int, dict[int, float]]  # threads -> {tokens: seconds}

    def threads(self, overlapped: bool) -> tuple[int, int]:
        """(the draft's, the target's) threads in a round of that kind."""
        i = 0 if overlapped else 1
        return self.draft_threads[i], self.target_threads[i]

    def verify_ratio(self, threads: int, tokens: float) -> float:
        """A target forward of `tokens` tokens on `threads` threads over the same on every core."""
        every = self.target_threads[1]
        if threads == every or threads not in self.verify:
            return 1.0
        return profiled(self.verify[threads], tokens) / profiled(self.verify[every], tokens)


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
    threads: int = 0  # the threads its steps ran with (0: not reported)


@dataclass
class Revisits:
    """At a load class where both regimes have run (see Measured): the faster, when the slower
    runs again (`due`, on the clock of measured seconds), the wait that set it, and while the
    slower runs, until when (None: the faster runs)."""

    faster: bool
    due: float
    wait: float
    until: float | None = None


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

    def mean_x(self) -> float:
        return self.x / self.w

    def fit(self) -> tuple[float, float] | None:
        """(y1, slope), the slope at least 0 (the mean and 0 where the line would cost nothing
        at x = 1); None while the points do not spread over enough x to fit a slope."""
        if self.w == 0:
            return None
        mean_x, mean_y = self.mean_x(), self.mean()
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

    def __init__(self, draft_profile: dict[int, float] | None = None, sharing: Sharing | None = None):
        self.lock = threading.Lock()
        # the draft's batched step of n sessions as its service timed it at start (Describe's
        # step_costs, at its own threads; {}: not reported), and the measured steps over it (see draft_cost)
        self.draft_profile = dict(draft_profile or {})
        self.sharing = sharing  # the services share one machine's cores (see Cores); None: they do not
        self.draft_scale = [0.0, 0.0]  # [sum, weight] of measured / profiled step, FIT_DECAY
        self.target_scale = [0.0, 0.0]  # the same for the target's steps on shared cores (target_step)
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
        # the sessions in the verify step of a speculating round over the generations running
        # (DECAY; explorations left out: a lone speculating round rides in everyone's step)
        self.shared = [0.0, 0.0]
        self.off_rounds = 0.0  # steps in a row (rounds of all generations, see update) without speculation
        self.explore_after = EXPLORE_EVERY  # steps off before the next exploration
        # a quiet round's measured seconds over its price, per load class (see Calibration):
        # {class: {speculated: [sum, weight]}}, each decayed by its own rounds (FIT_DECAY)
        self.priced: dict[int, dict[bool, list[float]]] = {}
        # prompts being prefilled on the pair, and a count of every start and end of one: a
        # round is quiet when the count did not move between its generation's commits
        self.prefilling = 0
        self.prefill_events = 0
        # under load, what the pair's rounds commit a second in each regime (see Measured): {class:
        # {speculating: [tokens, seconds x generations, seconds measured in all]}}, the first two
        # over the regime's latest run, decayed by RATE_WINDOW
        self.rates: dict[int, dict[bool, list[float]]] = {}
        self.regime: bool | None = None  # under load, whether the pair's rounds speculate
        self.settled = 0.0  # steps since the regime last changed
        self.last_commit: float | None = None  # when a round of the pair last committed
        self.faster: dict[int, Revisits] = {}  # per load class: the faster regime and its revisits
        self.settled_class = 0  # the load class of the last commit

    def verify_cost(self, k_max: int) -> tuple[float, float] | None:
        """(T1, b): target seconds for a step of one token and per extra token in the step;
        None while the steps do not spread over enough sizes to fit a slope."""
        line = self.verify.fit()
        return (self.verify.mean(), 0.0) if line is None and k_max <= 1 else line

    def threads(self, overlapped: bool) -> tuple[int | None, int | None]:
        """The threads of (the draft's, the target's) forwards in a round of that kind; None: the
        service's own (the services do not share cores)."""
        return self.sharing.threads(overlapped) if self.sharing is not None else (None, None)

    def _draft_curve(self, threads: int | None) -> dict[int, float]:
        """The draft's profile at `threads` threads (None, or not timed: at its own)."""
        if self.sharing is not None and threads in self.sharing.draft:
            return self.sharing.draft[threads]
        return self.draft_profile

    def verify_scale(self, threads: int | None) -> Callable[[float], float] | None:
        """What turns the verify line (fitted at every core's threads where the cores are shared)
        into the target's step at `threads`; None: the line as it is."""
        sharing = self.sharing
        if sharing is None or threads is None or threads == sharing.target_threads[1]:
            return None
        return lambda tokens: sharing.verify_ratio(threads, tokens)

    def target_step(self, tokens: float, threads: int | None = None) -> float | None:
        """Seconds of the target's batched step of `tokens` tokens on `threads` threads (None: every
        core), where the services share the cores: the target's profile at those threads (its
        forward of 1-65 tokens) scaled by what its quiet steps measured against the profile at
        theirs, as the draft's step is priced; None elsewhere, or before a step is measured. Under
        load the verify line is fitted over steps of a few sizes: its slope came out at 0-1.7 ms a
        token, and it priced a plain step of 16 on every core near a speculating one on a share."""
        sharing, (total, weight) = self.sharing, self.target_scale
        curve = sharing.verify.get(threads or sharing.target_threads[1]) if sharing is not None else None
        if not curve or not weight:
            return None
        return profiled(curve, tokens) * total / weight

    def draft_cost(self, sessions: int, threads: int | None = None) -> float:
        """Seconds a drafted token costs when `sessions` draft together: the draft's step for
        that many (draft_step) per token, plus what a round waits for the draft beyond its
        compute. While the step is unknown (no profile and the steps all of one size, or a
        service that reports neither), the mean measured cost, and for more sessions than its
        steps held, no batching assumed: measured by lone rounds only (a pair's first generations), a step of
        16 sessions was priced as one session's, speculation looked cheap at 16 clients, and
        each of them opened its draft and waited behind the others' prefills before its rounds
        measured otherwise. `threads`: its steps' (None: the service's own)."""
        step = self.draft_step(sessions, threads)
        if step is None:
            per_token = self.draft_seconds / self.draft_tokens
            if self.draft_line.w:  # against the sessions its steps held, on average
                per_token *= max(1.0, sessions / self.draft_line.mean_x())
            return per_token
        waited = max(0.0, self.draft_seconds - self.draft_compute)
        return (step * self.draft_steps + waited) / self.draft_tokens

    def draft_step(self, sessions: int, threads: int | None = None) -> float | None:
        """Seconds of the draft's batched step of `sessions` sessions on `threads` threads (None:
        its own): its service's profile at those threads scaled by what its steps measured against
        the profile at theirs (the curve's shape from the profile, its level from serving: a
        handler's and the worker's share of the core), else the line fitted over the steps
        measured; None while neither is known."""
        if self.draft_steps == 0:
            return None
        curve = self._draft_curve(threads)
        if curve:
            total, weight = self.draft_scale
            return profiled(curve, sessions) * (total / weight if weight else 1.0)
        line = self.draft_line.fit()
        return None if line is None else line[0] + line[1] * (sessions - 1)

    def sessions(self, load: int) -> float:
        """Generations whose blocks share a verify step when `load` speculate: all of them until
        measured (lockstep), then the share measured of the load."""
        total, weight = self.shared
        return load * (total / weight if weight else 1.0)

    def wait(self, speculating: bool) -> float:
        """Seconds a round waits on the target beyond its step's compute, speculating or not.
        Speculating rounds not measured lately: the others' (a wait measured at another load says
        little). Rounds without speculation: their own as last measured, never yet: the others'.
        Under load speculating rounds queue behind the steps of generations out of step with them
        (16 clients on 2 shared cores: 50-100 ms), where rounds without speculation share one
        step; priced with that queueing, a plain step of 16 looked 1.6x its measured cost, and
        adaptive lookahead speculated at 0.65x speculation off."""
        total, weight = self.waits[speculating]
        if weight < 0.5 if speculating else weight == 0:
            total, weight = self.waits[not speculating]
        return total / weight if weight else 0.0

    def prefill(self, started: bool) -> None:
        """A prefill on the pair started or ended (an OpenSession on either service, a draft's
        catch-up)."""
        with self.lock:
            self.prefilling += 1 if started else -1
            self.prefill_events += 1

    def quiet_since(self) -> int | None:
        """A mark for the start of a round (see Calibration): None while a prefill runs."""
        with self.lock:
            return None if self.prefilling else self.prefill_events

    def quiet(self, since: int | None) -> bool:
        """Whether no prefill ran since the mark `quiet_since` gave."""
        with self.lock:
            return since is not None and since == self.prefill_events and not self.prefilling

    def calibration(self, load: int) -> float | None:
        """What corrects speculation's priced gain at `load`: the plain rounds' measured/priced
        ratio there (1 until measured: their price is the verify line's, measured at every load)
        over the speculating rounds'; None until speculating rounds at that load are measured
        (see Calibration)."""
        kinds = self.priced.get(load_class(load), {})
        on, off = kinds.get(True, (0.0, 0.0)), kinds.get(False, (0.0, 0.0))
        if on[1] < CALIBRATED:
            return None
        return (off[0] / off[1] if off[1] >= CALIBRATED else 1.0) / (on[0] / on[1])

    def calibrate(self, load: int, speculated: bool, ratio: float) -> None:
        """A quiet round's measured/priced ratio, counted up to MISPRICED; its kind's window at
        its load decays by the round (a round of each of `load` generations is one step)."""
        kept = self.priced.setdefault(load_class(load), {True: [0.0, 0.0], False: [0.0, 0.0]})[speculated]
        share = 1 / max(1, load)  # a round of each generation is one step
        f = FIT_DECAY**share
        kept[0] = f * kept[0] + share * min(ratio, MISPRICED)
        kept[1] = f * kept[1] + share

    def measure(self, load: int, tokens: int, at: float) -> None:
        """A round of one of `load` generations committed `tokens` at `at` (seconds, the loop's
        clock): the time since the pair's last commit counts for the regime in force, once every
        generation has had a round in it and unless the pair was idle (see Measured)."""
        cls = load_class(load)
        if cls != self.settled_class:  # a step at a load before it counts there: the arrivals' prefills
            self.settled, self.settled_class = 0.0, cls
        seconds = max(0.0, at - self.last_commit) if self.last_commit is not None else IDLE
        if load > 1 and self.regime is not None and self.settled >= 1 and seconds < IDLE:
            kept = self.rates.setdefault(cls, {True: [0.0, 0.0, 0.0], False: [0.0, 0.0, 0.0]})
            rate, f = kept[self.regime], math.exp(-seconds / RATE_WINDOW)
            rate[0] = f * rate[0] + tokens
            rate[1] = f * rate[1] + seconds * load
            rate[2] += seconds
        self.last_commit = max(at, self.last_commit or at)  # rounds report from their own threads
        self.settled += 1 / max(1, load)

    @property
    def measured(self) -> float:
        """Seconds measured under load, at every load class and in both regimes: the clock of the
        revisits."""
        return sum(kept[2] for kinds in self.rates.values() for kept in kinds.values())

    def measured_choice(self, load: int, priced: bool) -> bool:
        """Under load, whether the pair's rounds speculate (see Measured), given the price's
        choice: plain rounds where it chooses them; where it chooses speculation, speculation
        until measured MEASURED seconds at this load, then plain rounds until they are too; then
        the faster, the slower revisited for MEASURED seconds after REVISIT, and after twice as
        long each time a revisit finds it slower still."""
        cls = load_class(load)
        kinds = self.rates.get(cls)
        on, off = (kinds[True][2], kinds[False][2]) if kinds else (0.0, 0.0)
        if not priced or off < MEASURED <= on:
            choice = False
        elif on < MEASURED:
            choice = True
        else:
            choice = self._revisits(cls, kinds)
        if choice != self.regime:  # a regime's rate is its latest run's
            self.regime, self.settled = choice, 0.0
            if kinds:
                kinds[choice][:2] = [0.0, 0.0]
        return choice

    def _revisits(self, cls: int, kinds: dict[bool, list[float]]) -> bool:
        """The regime at a load class where both have run: the faster, the slower for MEASURED
        seconds when its revisit is due (on the clock of measured seconds)."""
        clock, decided = self.measured, self.faster.get(cls)
        if decided is None or (decided.until is not None and clock >= decided.until):
            if not (kinds[True][1] and kinds[False][1]):  # a run not measured yet: the one in force
                return bool(self.regime)
            faster = kinds[True][0] / kinds[True][1] > kinds[False][0] / kinds[False][1]
            wait = min(2 * decided.wait, REVISIT_MAX) if decided and faster == decided.faster else REVISIT
            decided = self.faster[cls] = Revisits(faster, clock + wait, wait)
        elif decided.until is None and clock >= decided.due:
            decided.until = clock + MEASURED
        return decided.faster != (decided.until is not None)

    def update(
        self,
        proposed: int,
        accepted: int,
        draft: DraftCost,
        target_seconds: float,
        step: int,
        target_compute: float,
        sessions: int = 1,
        step_sessions: int | None = None,
        quiet: bool = True,
        target_threads: int = 0,
    ) -> None:
        """One round of one of `sessions` generations running: each reports its rounds, so the
        windows above count rounds of them all (a round of each of 16 generations is one step,
        not 16: counted one by one, the line's window shrank to two steps under load and its
        intercept swung from 12 to 234 ms). `step_sessions`: the sessions in its verify step,
        for a round that speculated with the others (None: not counted). `quiet`: no prefill ran on
        the pair during the round; one that did waited behind it, and its wait is not counted
        (see Calibration). `target_threads`: its verify step's (0: not reported); on shared cores
        the verify line is fitted at every core's threads (see Cores)."""
        share = 1 / max(1, sessions)
        d = DECAY**share
        if step_sessions:
            self.shared[0] = d * self.shared[0] + min(1.0, step_sessions / max(1, sessions))
            self.shared[1] = d * self.shared[1] + 1
        if quiet:
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
            if draft.steps and self.draft_profile and quiet:  # a step beside a prompt's chunks is no decode step
                f = FIT_DECAY**share
                curve = self._draft_curve(draft.threads or None)
                ratio = draft.compute / draft.steps / profiled(curve, draft.step_tokens / draft.steps)
                self.draft_scale = [f * self.draft_scale[0] + share * ratio, f * self.draft_scale[1] + share]
        self.usual_k = FIT_DECAY**share * self.usual_k + proposed
        curve = self.sharing.verify.get(target_threads) if self.sharing is not None else None
        if curve and quiet:
            f = FIT_DECAY**share
            ratio = target_compute / profiled(curve, step)
            self.target_scale = [f * self.target_scale[0] + share * ratio, f * self.target_scale[1] + share]
        scale = self.verify_scale(target_threads or None)
        self.verify.add(step, target_compute / scale(step) if scale else target_compute, share)


@dataclass
class AdaptiveLookahead:
    """One generation's policy over its pair's shared costs (a private PairCosts when none is
    given). Acceptance is the generation's own (its text), with the pair's as a prior of
    PRIOR_TRIALS trials: alone on a pair, the estimate is exactly its own."""

    k_max: int
    overlap: bool = False  # overlapped rounds allowed (see Pricing: chosen where they pay)
    fixed: bool = False  # k is k_max, always: only the kind of round is chosen (see Cores)
    load: Callable[[], int] = lambda: 1  # generations sharing the services' forwards
    costs: PairCosts = field(default_factory=PairCosts)
    accepted: float = 0.0
    rejections: float = 0.0
    speculating: bool | None = None  # under load: the side of the MARGIN band it is on (see Load)
    overlapping: bool = True  # with `overlap`: whether its last choice overlaps the rounds (see Pricing)
    exploring: bool = False  # its last choice was an exploration (see Load)
    # its last choice's price (see Calibration): a speculating round's (None: it chose none), a
    # plain round's, and the load it was priced at; None: unpriced. And the formula's gain for
    # it, before calibration
    priced: tuple[float | None, float, int] | None = None
    promised: float = 1.0

    def next_k(self) -> int:
        """The k for the next round (called once a round: it counts the steps off)."""
        with self.costs.lock:
            costs = self.costs
            k = self._best_k()
            if self.fixed:
                return k
            self.exploring = False
            if k > 0:
                costs.off_rounds, costs.explore_after = 0, EXPLORE_EVERY
                return k
            if self.load() > 1:  # under load the regimes' revisits explore (see Measured)
                return 0
            costs.off_rounds += 1 / max(1, self.load())  # counted in steps: a round of each generation is one
            if costs.off_rounds < costs.explore_after:
                return 0
            costs.off_rounds, costs.explore_after = 0, min(2 * costs.explore_after, EXPLORE_MAX)
            self.exploring = True
            return min(2, self.k_max)

    def would_speculate(self) -> bool:
        """Whether the next round would draft, asked before it (no round counted): a new
        generation opens its draft's session only then."""
        with self.costs.lock:
            return self.fixed or self._best_k() > 0

    def alpha(self) -> float | None:
        """Per-token acceptance: this generation's, the pair's as a prior; None: no evidence."""
        shared = self.costs.accepted + self.costs.rejections
        if shared == 0:
            return None
        prior = self.costs.accepted / shared
        return (self.accepted + PRIOR_TRIALS * prior) / (self.accepted + self.rejections + PRIOR_TRIALS)

    def _pricing(self, n: int) -> tuple[dict[bool, RoundCosts], float] | None:
        """Each kind of round's costs (overlapped: True) and t0, a plain round's, at a load of n;
        None while the target's step is neither profiled nor fitted over steps of several sizes."""
        costs = self.costs
        profiled_target = costs.target_step(1) is not None  # the target's step from its profile
        line = costs.verify_cost(self.k_max)
        # every step of one size: its mean, and no slope (under load the regimes' rates decide)
        if line is None and (self.fixed or profiled_target or n > 1):
            line = (costs.verify.mean(), 0.0)
        if line is None:
            return None
        wait_on, wait_off = costs.wait(True), min(costs.wait(False), costs.wait(True))  # see Load: w_off <= w_on
        # every generation drafting, as they all choose alike; each kind of round at its threads (see
        # Cores: under load, on the services' shares whatever the kind)
        rounds = {}
        for overlapped in (True, False):
            draft_threads, target_threads = costs.threads(overlapped or n > 1)
            rounds[overlapped] = RoundCosts(
                costs.draft_cost(n, draft_threads),
                line,
                wait_on,
                n,
                costs.sessions(n),
                shared=costs.sharing is not None and not overlapped and n == 1,
                scale=costs.verify_scale(target_threads),
                price=functools.partial(costs.target_step, threads=target_threads) if profiled_target else None,
            )
        # a round without speculation: a step of n one-token rounds, on every core
        plain = costs.target_step(n) if profiled_target else line[0] + line[1] * (n - 1)
        return rounds, plain + wait_off

    def _best_k(self) -> int:
        costs = self.costs
        self.priced = None
        alpha = self.alpha()
        if costs.verify.w == 0 or alpha is None or costs.draft_tokens == 0:
            return self.k_max
        n = max(1, self.load())
        pricing = self._pricing(n)
        if pricing is None:  # every recent step fed the same number of tokens: try another k
            usual = round(costs.usual_k / costs.verify.w)
            if usual == 0:  # rounds have been off: next_k's explorations (backing off) probe k = 2
                return 0
            return usual // 2 if usual >= 2 else min(self.k_max, usual + 2)
        rounds, t0 = pricing
        if self.fixed:  # the cheaper kind of round at k_max
            k = self.k_max
            self.overlapping = self.overlap and round_time(alpha, k, rounds[True], True) <= round_time(
                alpha, k, rounds[False], False
            )
            return k
        k, self.overlapping = best_lookahead(alpha, rounds, t0, self.k_max, self.overlap)
        if n > 1:
            self.promised = speedup(alpha, k, rounds[self.overlapping], self.overlapping, t0)
            calibration = costs.calibration(n)
            if calibration is None:  # not measured at this load: the formula must promise more than its error
                priced = self.promised > 1 + UNPROVEN
            else:
                priced = speculates(self.promised * calibration, self.speculating)
            self.speculating = costs.measured_choice(n, priced and k > 0)  # see Measured
            k = k if self.speculating else 0
        # the chosen k's price; k = 0: drafts it did not choose (an exploration's, carried) are not calibrated
        self.priced = (round_time(alpha, k, rounds[self.overlapping], self.overlapping) if k else None, t0, n)
        return k

    def update(
        self,
        proposed: int,
        accepted: int,
        draft: DraftCost | float,
        target_seconds: float,
        step_tokens: int | None = None,
        target_compute: float | None = None,
        step_sessions: int | None = None,
        round_seconds: float | None = None,
        quiet: bool = True,
        target_threads: int = 0,
        committed: int | None = None,
        at: float | None = None,
    ) -> None:
        """One round: drafts verified and accepted, what it waited for the draft (seconds alone:
        for the proposed tokens, the service's steps unknown), the seconds waited on the target,
        of which `target_compute` its step's (as the target reports; default: all), and the
        tokens of the target's batched forward that scored them (default: this round's alone,
        proposed + 1, as when no other session shares the target), the sessions it ran, the seconds
        since its generation's last commit (None: not timed), and whether no prefill ran on the
        pair meanwhile (one that did waited behind it: neither its wait nor its time is counted;
        see Calibration), the threads the target's step ran with (0: not reported), and the tokens
        it committed and when, on the loop's clock (None: not counted; see Measured)."""
        self.accepted = DECAY * self.accepted + accepted
        self.rejections = DECAY * self.rejections + (1 if accepted < proposed else 0)
        if not isinstance(draft, DraftCost):
            draft = DraftCost(draft, proposed)
        step = proposed + 1 if step_tokens is None else step_tokens
        with self.costs.lock:
            compute = target_seconds if target_compute is None else target_compute
            counted = step_sessions if proposed > 0 and not self.exploring else None
            self.costs.update(
                proposed, accepted, draft, target_seconds, step, compute, self.load(), counted, quiet, target_threads
            )
            if quiet and round_seconds and self.priced is not None and not self.exploring:
                spec_price, plain_price, load = self.priced
                price = plain_price if proposed == 0 else spec_price  # None: drafts it did not choose (carried)
                if price:
                    self.costs.calibrate(load, proposed > 0, round_seconds / price)
            if committed is not None and at is not None:
                self.costs.measure(self.load(), committed, at)


def measured_lookahead(costs: PairCosts, k_max: int, overlap: bool) -> int | None:
    """The fixed k for a request that names none (see Default k): the k in 1..k_max that the pair's
    costs and acceptance price fastest for a generation alone, each kind of round as `overlap`
    allows; None before the pair has measured them (its first rounds)."""
    probe = AdaptiveLookahead(k_max, overlap=overlap, costs=costs)  # its own acceptance: none, the pair's alone
    with costs.lock:
        alpha = probe.alpha()
        if alpha is None or costs.verify.w == 0 or costs.draft_tokens == 0:
            return None
        pricing = probe._pricing(1)
    if pricing is None:
        return None
    rounds, t0 = pricing
    k, _ = best_lookahead(alpha, rounds, t0, k_max, overlap)
    return max(1, k)
