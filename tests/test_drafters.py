"""Every drafter keeps the output exact: greedy equal to target-only decoding, and the chi-square
distribution test through the whole loop (with adaptive lookahead too). The lookahead's own
choices: test_adaptive_lookahead.py."""

from __future__ import annotations

import pytest

from draft_service.drafters import MODEL, NGRAM, make
from draft_service.ngram import lookup
from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.engine import SessionEngine
from target_service.server import TargetServicer
from tests.standins import Direct, MarkovBackend, markov_pair, random_markov
from tests.stats import markov_chisquare

DRAFTERS = {"model": MODEL, "ngram": NGRAM}


def run(draft, target, sampling, n, k=4, adaptive=False, speculate=True, seed=3):
    config = LoopConfig(sampling, n, lookahead=k, adaptive=adaptive, speculate=speculate, seed=seed)
    loop = SpeculativeLoop(draft, target, [0, 1, 2], config)
    ks = [r.proposed for r in loop.rounds()]
    return loop.generated, loop.stats, ks


def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # longest suffix [1, 2] seen before
    assert lookup([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the most recent occurrence wins
    assert lookup([1, 2, 3], 4) == []  # nothing repeats
    assert lookup([4, 4], 3) == [4]  # proposals stop at the end of the sequence
    assert lookup([7], 3) == []


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.usefixtures("draft_awaited")
def test_greedy_equals_target_only(drafter, adaptive):
    target_probs = random_markov(12, 31)
    draft, target = markov_pair(target_probs, random_markov(12, 32), DRAFTERS[drafter])
    greedy = SamplingParams()
    spec, stats, _ = run(draft, target, greedy, 150, k=5, adaptive=adaptive)
    plain, _, _ = run(draft, target, greedy, 150, speculate=False)
    assert spec == plain and stats.draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter,adaptive", [("ngram", False), ("model", True)])
def test_distribution_through_the_loop(drafter, adaptive):
    target_probs = random_markov(6, 41, alpha=0.3)  # peaked rows: n-grams repeat often
    draft, target = markov_pair(target_probs, random_markov(6, 42), DRAFTERS[drafter])
    tokens, stats, _ = run(draft, target, SamplingParams(temperature=1.0), 25_000, adaptive=adaptive)
    assert markov_chisquare([2, *tokens], target_probs) > 1e-3
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_unknown_drafter_is_refused():
    with pytest.raises(ValueError, match="unknown drafter 'eagle'"):
        make("eagle", None)


def test_a_draft_step_feeds_only_its_newest_token():
    """A round's k draft steps feed the draft's cache the committed tokens it lacks (one, or
    two after a fully accepted round) and then one token a step, not the whole proposed tail
    again each step (1 + 2 + ... + k): at most k + 1 tokens a round after the prefill."""
    fed = []
    draft_backend = MarkovBackend(random_markov(12, seed=5))
    forward = draft_backend.forward

    def counting_forward(cache, token_ids, n_logits):
        fed.append(len(token_ids))
        return forward(cache, token_ids, n_logits)

    draft_backend.forward = counting_forward
    target = TargetServicer(SessionEngine(MarkovBackend(random_markov(12, seed=5)), "target"))
    draft = DraftServicer(SessionEngine(draft_backend, "draft"), MODEL)
    _, stats, ks = run(Direct(draft), Direct(target), SamplingParams(temperature=1.0), 300, k=5)
    assert stats.accepted_tokens > 0.9 * stats.draft_tokens  # the same model: rounds run long
    assert sum(fed) <= 2 + sum(k + 1 for k in ks)  # the prompt [0, 1, 2] prefills 2 tokens
