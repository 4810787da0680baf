"""A draft whose prefill would outlast the answer, on cores the two services share, is not opened
(orchestrator.sessions, Long prompts): the rounds are the target's alone, several steps a Score.
Greedy and the invariant rule only (a Leviathan sample's text would depend on the timing); on
separate hosts or devices, and before the pair has timed a draft's open, the draft opens as before.
The text is the target alone's either way. The ratio is set far past any timing noise: what is
tested is the rule, not the clock."""

from __future__ import annotations

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
    and for a Leviathan sample, whose text would depend on when the draft is ready."""
    unmeasured = pair_costs(None)
    assert generate(unmeasured).stats.drafted_tokens > 0
    assert unmeasured.open_ratio.mean() is not None  # the first open, timed against the target's
    assert generate(pair_costs(1e9, sharing=None)).stats.drafted_tokens > 0
    sampled = generate(pair_costs(1e9), SAMPLED, rule="leviathan")
    assert sampled.stats.drafted_tokens > 0
