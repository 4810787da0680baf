"""The speculation cache (orchestrator.speculation_cache): which rejections it prepares for, and
when it prepares none; a round whose outcome was prepared starts from the prepared drafts; and
the output never changes (greedy, the invariant rule's seeded text), whatever the cache did."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.rounds import Proposal
from orchestrator.speculation_cache import REFEED_STEPS, CacheRates, Spare, branches
from specdec.decoding.sampling import SamplingParams
from specdec.v1 import orchestrator_pb2
from tests.harness import long_request, slow_pipeline
from tests.standins import MarkovBackend, random_markov
from tests.test_overlap import pair


def test_the_likeliest_rejections_first_while_each_is_worth_its_cost():
    rates = CacheRates()  # no outcome yet: every rate 0.5
    # Three drafts: a rejection at the first is likeliest (0.5 x 0.5), then at the second (x 0.5);
    # at the third (0.0625) a hit would spare 8 x 0.0625 = 0.5 steps, less than its miss costs.
    chosen = branches([0.9, 0.3, 0.9], [7, 8, 9], rates, fanout=3, steps=8)
    assert [(b.accepted, b.token) for b in chosen] == [(0, 7), (1, 8)]
    assert [b.chance for b in chosen] == [0.25, 0.125]
    assert [b.accepted for b in branches([0.9, 0.3, 0.9], [7, 8, 9], rates, fanout=1, steps=8)] == [0]
    # Short proposals spare little: a branch whose hit saves less than it costs is not prepared.
    assert branches([0.9, 0.3, 0.9], [7, 8, 9], rates, fanout=3, steps=1) == []


def test_measured_rates_decide():
    rates = CacheRates()
    for _ in range(200):  # confident drafts always accepted; at an unsure one the target takes the runner-up
        rates.update([0.95, 0.35, 0.95], [1, 2, 3], accepted=1, target_token=2)
    assert rates.accept(0.95) > 0.99 and rates.accept(0.35) < 0.01 and rates.guess(0.35) > 0.99
    [branch] = branches([0.95, 0.35, 0.95], [1, 2, 3], rates, fanout=3, steps=4)
    assert (branch.accepted, branch.token) == (1, 2) and branch.chance > 0.98
    never = CacheRates()
    for _ in range(200):  # every draft accepted: a rejection is too unlikely to prepare for
        never.update([0.6, 0.6, 0.6], [1, 2, 3], accepted=3, target_token=-1)
    assert branches([0.6, 0.6, 0.6], [1, 2, 3], never, fanout=3, steps=8) == []
    assert REFEED_STEPS > 0


def test_the_time_to_spare_bounds_the_fanout():
    spare = Spare()
    assert spare.fanout(4) == 1  # before it is measured
    spare.update(verify_wait=0.100, continuation=0.020, steps=5)  # 80 ms to spare, 4 ms a step
    assert spare.fanout(4) == 3  # 80 ms hold 5 proposals of 4 steps: MAX_BRANCHES
    spare.update(verify_wait=0.001, continuation=0.030, steps=5)
    for _ in range(30):
        spare.update(verify_wait=0.001, continuation=0.030, steps=5)
    assert spare.fanout(4) == 0  # the continuation is the longer side: nothing to spare


def test_a_round_without_drafts_prepares_nothing():
    """A round whose drafter proposed nothing (the hybrid renting, an index that found nothing)
    with its continuation's alternatives and a measured time to spare: no branch, no error (it
    divided by the round's k, 0: an INTERNAL error on the real pair with `--drafter hybrid`)."""
    target_probs = random_markov(10, 75, alpha=0.15)
    draft, target = pair(target_probs, swapped(target_probs, 76))
    loop = SpeculativeLoop(draft, target, [0, 1, 2], LoopConfig(SamplingParams(), 8, lookahead=4, overlap=True))
    loop._spare.update(verify_wait=0.100, continuation=0.020, steps=5)  # time to spare: 3 branches for k = 4
    after = Proposal([5, 6], [1.0, 1.0], [], alts=[(4, 0.6, 0.3), (7, 0.6, 0.3)])
    assert loop._branch(Proposal([], [], []), after) == []


class SlowTarget(MarkovBackend):
    """A target whose forward takes 30 ms: the draft has time to spare while it verifies."""

    def forward(self, cache, token_ids, n_logits):
        time.sleep(0.03)
        return super().forward(cache, token_ids, n_logits)


def swapped(target_probs: np.ndarray, seed: int, share: float = 0.4) -> np.ndarray:
    """A draft law: the target's, its two likeliest tokens swapped in `share` of the rows, so that
    where the two disagree the target's token is the draft's runner-up."""
    rng = np.random.default_rng(seed)
    draft = target_probs.copy()
    for row in np.flatnonzero(rng.random(len(draft)) < share):
        first, second = np.argsort(draft[row])[::-1][:2]
        draft[row, [first, second]] = draft[row, [second, first]]
    return draft


def run(draft, target, sampling, n, rule="leviathan", cache=True, speculate=True):
    config = LoopConfig(sampling, n, lookahead=4, speculate=speculate, seed=9, overlap=True, rule=rule, cache=cache)
    loop = SpeculativeLoop(draft, target, [0, 1, 2], config)
    for _ in loop.rounds():
        pass
    return loop.generated, loop.stats


@pytest.mark.parametrize(
    "sampling, rule", [(SamplingParams(), "leviathan"), (SamplingParams(temperature=1.0), "invariant")],
    ids=["greedy", "invariant"],
)  # fmt: skip
def test_prepared_rounds_are_used_and_the_output_is_the_targets(sampling, rule):
    target_probs = random_markov(10, 71, alpha=0.15)
    draft, _ = pair(target_probs, swapped(target_probs, 72))
    _, target = pair(target_probs, target_probs)
    target.servicer.engine.backend = SlowTarget(target_probs)
    alone, _ = run(draft, target, sampling, 60, rule, speculate=False)
    cached, stats = run(draft, target, sampling, 60, rule)
    assert cached == alone
    assert stats.cache_branches >= stats.cache_hits > 0  # rounds started from prepared drafts
    plain, without = run(draft, target, sampling, 60, rule, cache=False)
    assert plain == alone and without.cache_branches == 0


def test_not_under_the_leviathan_rule():
    """A Leviathan round's drafts are drawn with its own uniforms: the cache does not serve it."""
    target_probs = random_markov(10, 73, alpha=0.15)
    draft, target = pair(target_probs, swapped(target_probs, 74))
    _, stats = run(draft, target, SamplingParams(temperature=1.0), 40)
    assert stats.cache_branches == 0 and stats.draft_tokens > 0


@pytest.mark.slow
def test_through_the_services(tiny_backends):
    """Over gRPC: the branches are calls the loop cancels when not wanted; nothing is left behind."""
    with slow_pipeline(tiny_backends, delay=0.01) as p:
        request = long_request(60)
        alone = orchestrator_pb2.GenerateRequest()
        alone.CopyFrom(request)
        alone.speculation.disabled = True
        expected = p.orchestrator.Generate(alone, timeout=60).token_ids
        reply = p.orchestrator.Generate(request, timeout=60)  # overlapped, the cache on: the defaults
        assert reply.token_ids == expected and reply.stats.cache_branches > 0
        assert p.sessions_freed_within(5)
