"""The measured default alone on cores the two services share (orchestrator.sessions, Long
prompts): its draft opens on every core while its rounds wait, timed against the target's open, or
not at all where that open is priced above what speculation would save: the rounds are then the
target's alone, several steps a Score. Greedy and the invariant rule only (a Leviathan sample's text
would depend on the timing); a request that names its k, separate hosts or devices, and a pair that
has not timed a draft's open yet, open the draft as before. The text is the target alone's either
way. The ratio is set far past any timing noise: what is tested is the rule, not the clock."""

from __future__ import annotations

import time

import pytest

from draft_service.drafters import MODEL
from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.pair_costs import PairCosts, Sharing
from specdec.decoding.sampling import SamplingParams
from tests.standins import markov_pair, random_markov

TARGET, DRAFT = random_markov(12, 31, alpha=0.3), random_markov(12, 32)
# two cores: one thread each at once, or two each in turn (the services' profiles)
SHARED = Sharing((1, 2), (1, 2), {1: {1: 0.010}, 2: {1: 0.006}}, {1: {1: 0.040, 9: 0.080}, 2: {1: 0.025, 9: 0.050}})
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8)


def pair_costs(ratio: float | None, sharing: Sharing | None = SHARED) -> PairCosts:
    costs = PairCosts({}, sharing)
    if ratio is not None:
        costs.open_ratio.add(ratio)
    return costs


def generate(costs: PairCosts, sampling: SamplingParams = GREEDY, speculate: bool = True, **config) -> SpeculativeLoop:
    draft, target = markov_pair(TARGET, DRAFT, MODEL)
    config = {"measured": True, **config}  # the default: a request that names no lookahead
    loop = SpeculativeLoop(
        draft, target, [0, 1, 2], LoopConfig(sampling, 60, speculate=speculate, seed=3, **config), costs=costs
    )
    for _ in loop.rounds():
        pass
    assert draft.servicer.engine.open_sessions == 0
    return loop


@pytest.mark.parametrize(
    ("sampling", "rule"), [(GREEDY, "leviathan"), (SAMPLED, "invariant")], ids=["greedy", "invariant"]
)
def test_a_draft_that_would_outlast_the_answer_is_not_opened(sampling, rule):
    alone = generate(pair_costs(None), sampling, speculate=False, rule=rule).generated
    declined = generate(pair_costs(1e9), sampling, rule=rule)
    assert declined.generated == alone
    assert declined.stats.drafted_tokens == 0
    assert declined.stats.rounds < len(declined.generated)  # several steps a Score, as the target alone
    opened = generate(pair_costs(1e-9), sampling, rule=rule)
    assert opened.generated == alone and opened.stats.drafted_tokens > 0


def test_the_draft_opens_where_the_rule_does_not_apply():
    """Before a draft's open was timed (and then its first open is), on separate hosts or devices,
    for a request that names its k, and for a Leviathan sample, whose text would depend on when the
    draft is ready."""
    unmeasured = pair_costs(None)
    assert generate(unmeasured).stats.drafted_tokens > 0
    assert unmeasured.open_ratio.mean() is not None  # the first open, timed against the target's
    assert generate(pair_costs(1e9, sharing=None)).stats.drafted_tokens > 0
    assert generate(pair_costs(1e9), measured=False).stats.drafted_tokens > 0
    sampled = generate(pair_costs(1e9), SAMPLED, rule="leviathan")
    assert sampled.stats.drafted_tokens > 0


class SlowOpen:
    """A draft stub whose OpenSession answers after `seconds` (a draft that hangs while it opens)."""

    def __init__(self, stub, seconds: float):
        self.stub, self.seconds = stub, seconds

    def __getattr__(self, name):
        method = getattr(self.stub, name)
        if name != "OpenSession":
            return method

        def slow(request, timeout=None):
            time.sleep(self.seconds)
            return method(request, timeout=timeout)

        return slow


def test_a_draft_that_hangs_while_it_opens_costs_its_patience_not_its_hang():
    """The rounds wait for the draft's open OPEN_PATIENCE times its price (a second at least), then go
    on without it; an open past that is no price (it would keep every later draft from opening)."""
    draft, target = markov_pair(TARGET, DRAFT, MODEL)
    costs = pair_costs(1e-9)
    alone = generate(pair_costs(None), speculate=False).generated
    loop = SpeculativeLoop(
        SlowOpen(draft, 20.0), target, [0, 1, 2], LoopConfig(GREEDY, 60, seed=3, measured=True), costs=costs
    )
    started = time.monotonic()
    for _ in loop.rounds():
        pass
    assert loop.generated == alone
    assert time.monotonic() - started < 10.0  # not held for the open's 20 s
    assert loop.stats.drafted_tokens == 0
    assert costs.open_ratio.mean() == pytest.approx(1e-9)
