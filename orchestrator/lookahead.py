"""Adaptive lookahead: choose k per round, and the kind of round, from the acceptance and the measured costs.

AdaptiveLookahead is one generation's policy; what it prices from is the pair's
(orchestrator.pair_costs.PairCosts, shared by the pair's generations, which start from it). The
loop asks it the next k (`next_k`) and whether rounds overlap (`overlapping`), and feeds it each
round's measurements (`update`). Pure: no clock, no RPC, no rounds run here (orchestrator.loop),
no windows kept here (PairCosts). Before any evidence it uses k_max. The choice of k never
changes the output law (the rule is exact for every k), only the speed. `price` and
`measured_lookahead` price the pair for a generation alone (`specdec status`, the default k).
Why and what was measured: docs/adaptive.md. The sections the code refers to:

Policy. Each round picks the k in 0..k_max (0: no speculation) and, where overlapped rounds are
allowed, the kind of round, that maximise E[tokens] t0 / round_time(k), with E[tokens] =
(1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023), from the estimates of alpha, the
target's step T(m), the draft's step D(n) and the waits (docs/adaptive.md#the-estimates).

Pricing. round_time: the longest of the generation's own path and each device's work for a round
of all N = load() generations, s of them sharing a target step (measured; N until then); without
speculation t0 = T(N) + w_off (docs/adaptive.md#the-price-of-a-round).

Cores. Where the services share one machine's cores (PairCosts.sharing), an overlapped round runs
each on its share, a sequential one each on every core in turn; under load every round that
drafts runs on the shares. `fixed`: a fixed k, only the kind of round is chosen
(docs/adaptive.md#the-cores-two-placements).

Overlap under load. Where the services compute on devices of their own (two accelerators, two
hosts, stand-ins: the server sets PairCosts.overlap_load), past that many generations the rounds
are sequential, as a fixed k's are: the other generations' rounds keep each device busy while one
waits on the other, and a continuation is a call and draft work that a rejection throws away.
Their price, two devices' works and a path, is taken above 1 + MARGIN where unmeasured (the measured
regimes veto it), not 1 + UNPROVEN (docs/adaptive.md#overlap-under-load). On shared cores the price
chooses at every load: an overlapped round runs the two services on their shares at once.

Calibration. Under load the gain is corrected by the load's ratio of quiet rounds' time to their
price, plain over speculating (a round counts up to MISPRICED); where speculation is not measured
at a load it must promise 1 + UNPROVEN (docs/adaptive.md#calibration-by-quiet-rounds), past
overlap_load on devices of their own 1 + MARGIN (see Overlap under load).

Measured. Under load the pair's rounds run in one regime; each regime's measured rate (MEASURED,
RATE_WINDOW, REVISIT up to REVISIT_MAX, IDLE, PEAK) vetoes the price's speculation; which k
speculation takes stays the price's (docs/adaptive.md#measured-regimes-under-load).

Load. Windows count steps (a round of each of N generations is one). Under load speculation is
taken above 1 + MARGIN and dropped below 1 - MARGIN; alone one round explores k = 2 after
EXPLORE_EVERY steps off, backing off up to EXPLORE_MAX (docs/adaptive.md#load-hysteresis-and-exploration).

Default k. measured_lookahead: the k in 1..MEASURED_LOOKAHEAD priced fastest for a generation
alone (DEFAULT_LOOKAHEAD before any measurement), for greedy or invariant chains. `measured`:
alone that k (or plain rounds where the start-up calibration timed them clearly faster: PairCosts.alone_plain),
under load that k or 0 as the regimes decide (docs/adaptive.md#the-default-k).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from orchestrator.pair_costs import DECAY, EXPLORE_EVERY, PairCosts, RoundReport

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

    def unexplored(self) -> None:
        """The round next_k chose to explore went without drafts (the draft's session still opening):
        the next round explores instead, at the same wait (else the wait doubled on no evidence, and a
        generation whose draft opens on its first exploration never measured one)."""
        with self.costs.lock:
            if self.exploring:
                self.exploring = False
                costs = self.costs
                costs.explore_after = max(EXPLORE_EVERY, costs.explore_after / 2)
                costs.off_rounds = costs.explore_after

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
        apart = costs.overlap_load is not None and n > costs.overlap_load  # see Overlap under load
        overlap = self.overlap and not apart
        if self.fixed:  # the cheaper kind of round at k_max
            k = self.k_max
            times = {mode: round_time(alpha, k, rounds[mode], mode) for mode in (True, False)}
            self.overlapping = overlap and times[True] <= times[False]
            if n == 1:
                return k
            if not self.measured:  # under load its rounds calibrate the price (see Calibration)
                self.priced = (times[self.overlapping], t0, n)
                return k
        else:
            k, self.overlapping = best_lookahead(alpha, rounds, t0, self.k_max, overlap)
        if n > 1:
            self.promised = speedup(alpha, k, rounds[self.overlapping], self.overlapping, t0)
            calibration = costs.calibration(n)
            if calibration is None:  # not measured at this load: the formula must promise more than its error
                priced = self.promised > 1 + (MARGIN if apart else UNPROVEN)
            else:
                priced = speculates(self.promised * calibration, self.speculating)
            self.speculating = costs.measured_choice(n, priced and k > 0)  # see Measured
            k = k if self.speculating else 0
        # the chosen k's price; k = 0: drafts it did not choose (an exploration's, carried) are not calibrated
        self.priced = (round_time(alpha, k, rounds[self.overlapping], self.overlapping) if k else None, t0, n)
        return k

    def update(self, report: RoundReport) -> None:
        """One round (RoundReport): its acceptance to this generation's estimate, its costs to the
        pair's, its time against the price that chose it (see Calibration), and its committed
        tokens to the regime's rate (see Measured)."""
        model = self.costs.drafted_by_model(report)  # a hybrid's index round: not its model's
        if model:
            self.accepted = DECAY * self.accepted + report.accepted
            self.rejections = DECAY * self.rejections + (1 if report.accepted < report.proposed else 0)
        with self.costs.lock:
            self.costs.update(report, self.load(), counted=not self.exploring)
            if model and report.quiet and report.round_seconds and self.priced is not None and not self.exploring:
                spec_price, plain_price, load = self.priced
                price = plain_price if report.proposed == 0 else spec_price  # None: drafts it did not choose (carried)
                if price:
                    self.costs.calibrate(load, report.proposed > 0, report.round_seconds / price)
            # a fixed k's rounds are not a regime's
            if report.committed is not None and report.at is not None and self.may_stop:
                self.costs.measure(self.load(), report.committed, report.at, report.span())


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
    # a generation alone: speculation's speed over plain rounds', as the start-up calibration timed
    # both (or `speedup`, where that is below 1: not timed); 0: not timed
    timed: float = 0.0
    plain_alone: bool = False  # a request alone that names no lookahead runs plain rounds (PairCosts.alone_plain)

    def summary(self) -> str:
        kind = "overlapped" if self.overlapped else "sequential"
        ms = [1e3 * t for t in (self.draft_token_seconds, self.verify_seconds, self.plain_token_seconds)]
        line = (
            f"k = {self.lookahead} ({kind} rounds), acceptance {self.acceptance:.2f}, a draft token {ms[0]:.1f} ms, "
            f"a verify of {self.lookahead + 1} {ms[1]:.1f} ms, a token alone {ms[2]:.1f} ms: {self.speedup:.2f}x"
        )
        if self.timed:
            line += f"; timed alone {self.timed:.2f}x plain rounds"
            line += " (a request alone runs plain rounds)" if self.plain_alone else ""
        return line


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
            costs.alone_gain or 0.0,
            costs.alone_plain(),
        )


def measured_lookahead(costs: PairCosts, k_max: int, overlap: bool) -> int | None:
    """The fixed k for a request that names none (see Default k): `price`'s; None before the pair
    has measured its costs."""
    priced = price(costs, k_max, overlap)
    return None if priced is None else priced.lookahead
