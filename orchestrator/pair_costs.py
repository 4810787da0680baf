"""What the rounds of every generation on one draft/target pair measure (PairCosts): the target's
verify line and profiled steps, the draft's cost line, the waits, the acceptance, each kind of
round's measured/priced ratio per load (Calibration) and each regime's rate under load (Measured).
The policy that reads them, and the reference for every estimate here, is orchestrator.lookahead
(its docstring: Policy, Calibration, Measured, Cores, Load). Pure: no clock of its own, no RPC; the
loop's rounds feed it, under its lock."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

DECAY = 0.8  # weight of the past per step (a round of each generation): a window of ~5 steps
FIT_DECAY = 0.97  # the same for the cost lines: ~30 steps
MIN_SPREAD = 0.1  # weighted variance of tokens scored below which the slope is unknown
EXPLORE_EVERY = 8  # steps without speculation before one round tries it again
MISPRICED = 3.0  # a round's measured/priced ratio counted at most (see Calibration)
CALIBRATED = 1.0  # steps (a round of each generation) a kind of round needs at a load before its ratio counts
MEASURED = 4.0  # seconds a regime runs at a load for its rate to count (see Measured)
REVISIT = 40.0  # seconds before the regime that measured slower runs again for MEASURED seconds
REVISIT_MAX = 320.0  # the longest wait, after revisits that found it slower still (doubling)
RATE_WINDOW = 10.0  # seconds of a regime's run its rate weighs (older ones decay by e each)
IDLE = 1.0  # seconds without a commit on the pair that are a pause, not a measurement
# seconds of commits whose busiest load names the regimes' load class (PairCosts.regime_class): the
# load of clients whose requests end together falls to 1 and climbs back within a round
PEAK = 1.0
# A generation alone runs plain rounds where the start-up calibration timed speculation below this
# share of plain rounds' speed (PairCosts.alone_gain; where it priced it below 1, below 1). Not 1:
# its answers of 40 tokens time within +-5% of 1 from start to start on the default pair (0.94-1.06
# over four starts, the model draft alone), and a fixed cost a request (the draft's open and
# prefill) weighs more on them than on most answers: warm, speculation ran 0.91-0.99x plain rounds
# on those prompts at 40 tokens and 1.09-1.17x at 128. Below 1, half the starts served every
# request alone plain rounds.
ALONE_PLAIN = 0.9


def load_class(load: int) -> int:
    """The loads calibrated together (see Calibration): 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8..."""
    return max(0, load - 1).bit_length()


def queued(waited: float, compute: float) -> float:
    """What a request waited beyond its compute, counted up to two computes: a request arriving
    during a step waits for it (about as long as its own), no more, while the load holds; a
    longer wait is a transient (behind the prefills of a wave of new prompts: seconds) that
    says nothing of the rounds to come."""
    return min(max(0.0, waited - compute), 2 * compute)


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


class DecayedMean:
    """A mean whose past weighs less: each `add` first decays what is kept by its `decay` (per step:
    DECAY or FIT_DECAY to the power of the round's share of a step)."""

    __slots__ = ("total", "weight")

    def __init__(self):
        self.total = self.weight = 0.0

    def add(self, value: float, weight: float = 1.0, decay: float = 1.0) -> None:
        self.total = decay * self.total + weight * value
        self.weight = decay * self.weight + weight

    def fade(self, decay: float) -> None:
        """Decay what is kept, adding nothing (a step that measured another kind)."""
        self.total *= decay
        self.weight *= decay

    def mean(self, default: float | None = None) -> float | None:
        return self.total / self.weight if self.weight else default


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


@dataclass(frozen=True)
class RoundReport:
    """One round as the loop measured it, for the policy (AdaptiveLookahead.update) and the pair's
    costs (PairCosts.update): drafts `proposed` and `accepted`; what it waited for the draft (a
    DraftCost, or seconds alone for the proposed tokens, the service's steps unknown); the seconds
    waited on the target, of which `target_compute` its step's (as the target reports; None: all);
    the tokens of the target's batched forward that scored them (None: this round's alone,
    proposed + 1, as when no other session shares the target) and the sessions it ran; the seconds
    since its generation's last commit (None: not timed); whether no prefill ran on the pair
    meanwhile (one that did waited behind it: neither its wait nor its time is counted; see
    Calibration); the threads the target's step ran with (0: not reported); the tokens it
    committed and when, on the loop's clock (None: not counted; see Measured); and whether its
    drafts came from the drafter's index, without a forward (`indexed`: a hybrid's index round, whose
    drafts are not its model's: PairCosts.index_apart); and the target steps it stands for (a decode
    round's report: its waits and time each a step's share, plain_rounds)."""

    proposed: int
    accepted: int
    draft: DraftCost | float = 0.0
    target_seconds: float = 0.0
    step_tokens: int | None = None
    target_compute: float | None = None
    step_sessions: int | None = None
    round_seconds: float | None = None
    quiet: bool = True
    target_threads: int = 0
    committed: int | None = None
    at: float | None = None
    indexed: bool = False
    steps: int = 1

    def draft_cost(self) -> DraftCost:
        return self.draft if isinstance(self.draft, DraftCost) else DraftCost(self.draft, self.proposed)

    def span(self) -> float:
        """Seconds its generation spent on the round (0: not timed)."""
        return (self.round_seconds or 0.0) * self.steps

    def step(self) -> int:
        """The tokens of the target's step that scored it."""
        return self.proposed + 1 if self.step_tokens is None else self.step_tokens

    def compute(self) -> float:
        """The target's compute in its wait."""
        return self.target_seconds if self.target_compute is None else self.target_compute


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

    def __init__(
        self,
        draft_profile: dict[int, float] | None = None,
        sharing: Sharing | None = None,
        index_apart: bool = False,
        overlap_load: int | None = None,
    ):
        self.lock = threading.Lock()
        # generations running past which adaptive lookahead's rounds do not overlap (services on
        # devices of their own: see lookahead's Overlap under load); None: the price chooses at every load
        self.overlap_load = overlap_load
        # the draft has a model beside its index (the hybrid): its index rounds (RoundReport.indexed)
        # count for the target's side only. Their drafts cost no forward and are accepted as a copy
        # is, so counted as the model's they priced its rounds from no draft cost and a copy's
        # acceptance: after 18 code requests the default pair priced k = 16 at 4.57x, a draft token
        # at 0.1 ms, and its chat answers ran 1.05x llama.cpp alone against the model draft's 1.45x.
        # A drafter that is an index alone (ngram, suffix) is priced by its index rounds.
        self.index_apart = index_apart
        # the draft's batched step of n sessions as its service timed it at start (Describe's
        # step_costs, at its own threads; {}: not reported), and the measured steps over it (see draft_cost)
        self.draft_profile = dict(draft_profile or {})
        self.sharing = sharing  # the services share one machine's cores (see Cores); None: they do not
        self.carried_over = False  # the start took a predecessor's measurements (carry_over), not its own
        # a generation alone: the measured default's speed over plain rounds', as the start-up
        # calibration timed both on its prompts, or its price where that is below 1
        # (orchestrator.calibration); None: neither (no calibration, or a drafter with index
        # drafts). Below ALONE_PLAIN (timed) or 1 (priced): alone, plain rounds (alone_plain)
        self.alone_gain: float | None = None
        self.alone_timed = False  # alone_gain is a timing's (else the price's)
        self.draft_scale = DecayedMean()  # measured / profiled step, FIT_DECAY
        self.target_scale = DecayedMean()  # the same for the target's steps on shared cores (target_step)
        self.accepted = 0.0  # all generations' rounds, weighted by DECAY
        self.rejections = 0.0
        self.tally = (0.0, 0.0)  # the same, every round weighing alike (pool_acceptance)
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
        # behind a step in progress), weighted by DECAY: for rounds that speculated (k > 0) and
        # rounds that did not
        self.waits = {True: DecayedMean(), False: DecayedMean()}
        # the sessions in the verify step of a speculating round over the generations running
        # (DECAY; explorations left out: a lone speculating round rides in everyone's step)
        self.shared = DecayedMean()
        self.off_rounds = 0.0  # steps in a row (rounds of all generations, see update) without speculation
        self.explore_after = EXPLORE_EVERY  # steps off before the next exploration
        # a quiet round's measured seconds over its price, per load class (see Calibration):
        # {class: {speculated: mean}}, each decayed by its own rounds (FIT_DECAY)
        self.priced: dict[int, dict[bool, DecayedMean]] = {}
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
        # the start of this PEAK window of commits, its busiest load, and the window before's
        self.peak: tuple[float, int, int] = (-math.inf, 0, 0)

    # What the pair's services and this process give, not what its rounds measured: not carried over
    # by `snapshot()` / `carry_over()`.
    LIVE = frozenset(
        {
            "lock",
            "overlap_load",
            "index_apart",
            "draft_profile",
            "sharing",
            "prefilling",
            "prefill_events",
            "last_commit",
            "peak",
            "carried_over",
        }
    )

    def snapshot(self) -> dict:
        """A copy of what the rounds measured (the prices' inputs), for a successor on the same pair."""
        with self.lock:
            return copy.deepcopy({k: v for k, v in vars(self).items() if k not in self.LIVE})

    def carry_over(self, state: dict) -> bool:
        """Take a predecessor's `snapshot()`; False (nothing taken) where its fields are not this
        code's (another version wrote it)."""
        if set(state) != set(vars(self)) - self.LIVE:
            return False
        with self.lock:
            vars(self).update(state)
            self.carried_over = True
        return True

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
        sharing, scale = self.sharing, self.target_scale.mean()
        curve = sharing.verify.get(threads or sharing.target_threads[1]) if sharing is not None else None
        if not curve or scale is None:
            return None
        return profiled(curve, tokens) * scale

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
            return profiled(curve, sessions) * self.draft_scale.mean(1.0)
        line = self.draft_line.fit()
        return None if line is None else line[0] + line[1] * (sessions - 1)

    def sessions(self, load: int) -> float:
        """Generations whose blocks share a verify step when `load` speculate: all of them until
        measured (lockstep), then the share measured of the load."""
        return load * self.shared.mean(1.0)

    def wait(self, speculating: bool) -> float:
        """Seconds a round waits on the target beyond its step's compute, speculating or not.
        Speculating rounds not measured lately: the others' (a wait measured at another load says
        little). Rounds without speculation: their own as last measured, never yet: the others'.
        Under load speculating rounds queue behind the steps of generations out of step with them
        (16 clients on 2 shared cores: 50-100 ms), where rounds without speculation share one
        step; priced with that queueing, a plain step of 16 looked 1.6x its measured cost, and
        adaptive lookahead speculated at 0.65x speculation off."""
        waits = self.waits[speculating]
        if waits.weight < 0.5 if speculating else waits.weight == 0:
            waits = self.waits[not speculating]
        return waits.mean(0.0)

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
        on, off = kinds.get(True, DecayedMean()), kinds.get(False, DecayedMean())
        if on.weight < CALIBRATED:
            return None
        return (off.mean() if off.weight >= CALIBRATED else 1.0) / on.mean()

    def calibrate(self, load: int, speculated: bool, ratio: float) -> None:
        """A quiet round's measured/priced ratio, counted up to MISPRICED; its kind's window at
        its load decays by the round (a round of each of `load` generations is one step)."""
        kept = self.priced.setdefault(load_class(load), {True: DecayedMean(), False: DecayedMean()})[speculated]
        share = 1 / max(1, load)  # a round of each generation is one step
        kept.add(min(ratio, MISPRICED), share, FIT_DECAY**share)

    def regime_class(self, load: int) -> int:
        """The load class whose regime runs and is measured at `load`: the busiest load of the
        pair's commits over the last PEAK to 2 x PEAK seconds, or `load` where busier (a dip as
        requests end together is no change of load: docs/adaptive.md#measured-regimes-under-load)."""
        return load_class(max(load, self.peak[1], self.peak[2]))

    def measure(self, load: int, tokens: int, at: float, span: float = 0.0) -> None:
        """A round of one of `load` generations committed `tokens` at `at` (seconds, the loop's
        clock) after `span` seconds of its own (RoundReport.span): the time since the pair's last
        commit counts for the regime in force at its load class (`regime_class`), once every
        generation has had a round in it and unless the pair was idle, IDLE seconds of it outside
        the round (a unary answer's plain rounds commit it at once: see Measured)."""
        start, busiest, before = self.peak
        if at >= start + PEAK:
            self.peak = (at, load, busiest if at < start + 2 * PEAK else 0)
        elif load > busiest:
            self.peak = (start, load, before)
        cls = self.regime_class(load)
        if cls != self.settled_class:  # a step at a load before it counts there: the arrivals' prefills
            self.settled, self.settled_class = 0.0, cls
        seconds = max(0.0, at - self.last_commit) if self.last_commit is not None else IDLE
        if load > 1 and self.regime is not None and self.settled >= 1 and seconds - span < IDLE:
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
        cls = self.regime_class(load)
        if cls > load_class(load) and self.regime is not None:  # a dip (regime_class): the regime runs on
            return self.regime
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

    def drafted_by_model(self, report: RoundReport) -> bool:
        """Whether a round's drafts count as the draft's: not a hybrid's index round (index_apart)."""
        return not (report.indexed and self.index_apart)

    def pool_acceptance(self, since: tuple[float, float]) -> None:
        """The acceptance as every round since `since` (a `tally` taken before them) gives it, each
        weighing alike, in place of the last few rounds' (DECAY), at the same weight: the start-up
        calibration's prompts of several kinds priced together. Its last prompt's last ~5 rounds
        alone gave 0.93-1.00 from start to start (code ends it), and the first request's k and kind
        of round swung with them (k = 14 overlapped at 1.00: the demo 0.78x; pooled 0.89-0.95,
        docs/adaptive.md#the-default-k)."""
        with self.lock:
            accepted, rejections = self.tally[0] - since[0], self.tally[1] - since[1]
            weight = self.accepted + self.rejections
            if accepted + rejections > 0 and weight > 0:
                self.accepted = weight * accepted / (accepted + rejections)
                self.rejections = weight - self.accepted

    def alone_plain(self) -> bool:
        """Whether a generation alone that names no lookahead runs plain rounds (see ALONE_PLAIN)."""
        return self.alone_gain is not None and self.alone_gain < (ALONE_PLAIN if self.alone_timed else 1.0)

    def update(self, report: RoundReport, sessions: int = 1, counted: bool = True) -> None:
        """One round of one of `sessions` generations running: each reports its rounds, so the
        windows above count rounds of them all (a round of each of 16 generations is one step,
        not 16: counted one by one, the line's window shrank to two steps under load and its
        intercept swung from 12 to 234 ms). `counted`: the report's step_sessions, the sessions in
        its verify step, say how many shared it (a round that speculated with the others; not an
        exploration's). A round beside a prefill (not `quiet`) waited behind it, and its wait is not
        counted (see Calibration). On shared cores the verify line is fitted at every core's threads
        (see Cores), the report's target_threads."""
        proposed, accepted, quiet = report.proposed, report.accepted, report.quiet
        draft, target_compute, step = report.draft_cost(), report.compute(), report.step()
        target_threads = report.target_threads
        step_sessions = report.step_sessions if counted and proposed > 0 else None
        share = 1 / max(1, sessions)
        d = DECAY**share
        if step_sessions:
            self.shared.add(min(1.0, step_sessions / max(1, sessions)), decay=d)
        if quiet:
            self.waits[proposed > 0].add(queued(report.target_seconds, target_compute), decay=d)
            self.waits[proposed == 0].fade(d)
        model = self.drafted_by_model(report)  # the draft's side: its model's rounds only
        if model:
            rejected = 1 if accepted < proposed else 0
            self.accepted = d * self.accepted + accepted
            self.rejections = d * self.rejections + rejected
            self.tally = (self.tally[0] + accepted, self.tally[1] + rejected)
        if draft.tokens and model:
            # its queueing capped as the target's is (steps 0: no compute reported, all of it counts)
            seconds = draft.compute + queued(draft.seconds, draft.compute) if draft.steps else draft.seconds
            self.draft_seconds = d * self.draft_seconds + seconds
            self.draft_compute = d * self.draft_compute + (draft.compute if draft.steps else 0.0)
            self.draft_steps = d * self.draft_steps + draft.steps
            self.draft_tokens = d * self.draft_tokens + draft.tokens
            if draft.steps:
                self.draft_line.add(draft.step_tokens / draft.steps, draft.compute / draft.steps, share)
            if draft.steps and self.draft_profile and quiet:  # a step beside a prompt's chunks is no decode step
                curve = self._draft_curve(draft.threads or None)
                ratio = draft.compute / draft.steps / profiled(curve, draft.step_tokens / draft.steps)
                self.draft_scale.add(ratio, share, FIT_DECAY**share)
        self.usual_k = FIT_DECAY**share * self.usual_k + proposed
        curve = self.sharing.verify.get(target_threads) if self.sharing is not None else None
        if curve and quiet:
            self.target_scale.add(target_compute / profiled(curve, step), share, FIT_DECAY**share)
        scale = self.verify_scale(target_threads or None)
        self.verify.add(step, target_compute / scale(step) if scale else target_compute, share)
