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
A fixed k's rounds under load are compared with their price too: they speculate, as the pair's
would, and what they measured is evidence at their load (after 30 s of k = 4 at 8 clients, a
generation of adaptive lookahead, promised 1.69x by the formula uncalibrated, measured
speculation for 8 s at 0.4x plain rounds' rate: 0.89x speculation off over the 60 s). Only the
drafts the policy chose are compared with a price (an exploration's continuation,
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
measured them (DEFAULT_LOOKAHEAD, 4, before; an orchestrator measures them before it serves,
orchestrator.calibration). Only where its text does not depend on k (greedy,
the invariant rule) and for chains: a Leviathan sample keeps 4 so that its seed replays whatever
ran on the pair before it. Such a generation keeps a fixed policy (`measured`), so its rounds go on
measuring the pair. Alone it always speculates at that k. Under load it speculates or not as
adaptive lookahead's regimes do (Load, Measured: the price, its calibration, the measured rates),
at that k or at 0: priced for a generation alone, k = 4 ran 0.53x speculation off at 8 clients
(48-token answers, 2026-11-27), and a default that keeps speculating under load serves half as
many tokens as `--no-speculation`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from orchestrator.pair_costs import DECAY, EXPLORE_EVERY, DraftCost, PairCosts

MARGIN = 0.1  # under load, the gain speculation must promise to be taken: the model's error there
EXPLORE_MAX = 128  # the longest wait, after explorations that found speculation does not pay
PRIOR_TRIALS = 2.0  # weight, in draft tokens tested, of the pair's acceptance in a generation's
UNPROVEN = 0.5  # under load, the gain the formula must promise where speculation is not calibrated


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens] a round of k drafts commits: (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha 1."""
    return k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def speculates(gain: float, speculating: bool | None) -> bool:
    """Under load: whether to speculate, given the best k's expected gain and whether the rounds
    speculate now (None: no decision yet, taken when it gains); taken above 1 + MARGIN, dropped
    below 1 - MARGIN, kept in between."""
    if speculating is None:
        return gain > 1
    return gain >= (1 - MARGIN if speculating else 1 + MARGIN)


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


@dataclass
class AdaptiveLookahead:
    """One generation's policy over its pair's shared costs (a private PairCosts when none is
    given). Acceptance is the generation's own (its text), with the pair's as a prior of
    PRIOR_TRIALS trials: alone on a pair, the estimate is exactly its own."""

    k_max: int
    overlap: bool = False  # overlapped rounds allowed (see Pricing: chosen where they pay)
    fixed: bool = False  # k is k_max, always: only the kind of round is chosen (see Cores)
    measured: bool = False  # with fixed: the measured default's k_max, or under load 0 (see Default k)
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
            return (self.fixed and not self.measured) or self._best_k() > 0

    @property
    def may_stop(self) -> bool:
        """Whether its rounds may go without drafts: adaptive lookahead, and the measured default
        under load."""
        return not self.fixed or self.measured

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
            times = {mode: round_time(alpha, k, rounds[mode], mode) for mode in (True, False)}
            self.overlapping = self.overlap and times[True] <= times[False]
            if n == 1:
                return k
            if not self.measured:  # under load its rounds calibrate the price (see Calibration)
                self.priced = (times[self.overlapping], t0, n)
                return k
        else:
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
            if committed is not None and at is not None and self.may_stop:  # a fixed k's are not a regime's
                self.costs.measure(self.load(), committed, at)


@dataclass(frozen=True)
class Price:
    """What the pair's costs and acceptance price for a generation alone (Describe's pricing)."""

    lookahead: int  # the k a request that names none runs at (measured_lookahead)
    overlapped: bool  # its rounds overlapped (the draft's next round beside the verify) or sequential
    acceptance: float  # per drafted token, the pair's
    draft_token_seconds: float  # a drafted token
    verify_seconds: float  # the target's step of lookahead + 1 tokens
    plain_token_seconds: float  # a round without speculation (one token)
    speedup: float  # the formula's, over rounds without speculation

    def summary(self) -> str:
        kind = "overlapped" if self.overlapped else "sequential"
        ms = [1e3 * t for t in (self.draft_token_seconds, self.verify_seconds, self.plain_token_seconds)]
        return (
            f"k = {self.lookahead} ({kind} rounds), acceptance {self.acceptance:.2f}, a draft token {ms[0]:.1f} ms, "
            f"a verify of {self.lookahead + 1} {ms[1]:.1f} ms, a token alone {ms[2]:.1f} ms: {self.speedup:.2f}x"
        )


def price(costs: PairCosts, k_max: int, overlap: bool) -> Price | None:
    """The k in 1..k_max that the pair's costs and acceptance price fastest for a generation alone,
    each kind of round as `overlap` allows, with what priced it; None before the pair has measured
    them (its first rounds)."""
    probe = AdaptiveLookahead(k_max, overlap=overlap, costs=costs)  # its own acceptance: none, the pair's alone
    with costs.lock:  # the prices read the costs: under the lock
        alpha = probe.alpha()
        if alpha is None or costs.verify.w == 0 or costs.draft_tokens == 0:
            return None
        pricing = probe._pricing(1)
        if pricing is None:
            return None
        rounds, t0 = pricing
        k, overlapped = best_lookahead(alpha, rounds, t0, k_max, overlap)
        k = max(1, k)  # it was asked to speculate: the smallest k where none pays
        chosen = rounds[overlapped]
        return Price(
            k,
            overlapped,
            alpha,
            chosen.draft,
            chosen.step(k + 1),
            t0,
            speedup(alpha, k, chosen, overlapped, t0),
        )


def measured_lookahead(costs: PairCosts, k_max: int, overlap: bool) -> int | None:
    """The fixed k for a request that names none (see Default k): `price`'s; None before the pair
    has measured its costs."""
    priced = price(costs, k_max, overlap)
    return None if priced is None else priced.lookahead
