"""The whole orchestrator loop (SpeculativeLoop -> servicers -> SessionEngine) with stand-in
models of fixed Markov distributions: its output law is the target's, after the sampling
transform, and greedy output is the target's argmax chain."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from draft_service.server import DraftServicer
from orchestrator import plain_rounds
from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.plain_rounds import MAX_PLAIN_STEPS, MAX_UNARY_STEPS, PLAIN_STEPS, decode_steps
from orchestrator.sessions import new_session_id
from specdec.decoding.sampling import SamplingParams, probs_from_logits
from specdec.runtime.engine import SessionEngine
from target_service.server import TargetServicer
from tests.standins import Direct, MarkovBackend, random_markov
from tests.stats import markov_chisquare

N_TOKENS = 15_000  # chi-square power to spare: the draft law still fails (p < 1e-3)


def pair(target_probs, draft_probs):
    target = TargetServicer(SessionEngine(MarkovBackend(target_probs), "target"))
    draft = DraftServicer(SessionEngine(MarkovBackend(draft_probs), "draft"))
    return Direct(draft), Direct(target), draft.engine, target.engine


def run(draft, target, sampling, k, n_tokens, seed, speculate=True, **kw):
    config = LoopConfig(sampling=sampling, max_new_tokens=n_tokens, lookahead=k, seed=seed, speculate=speculate, **kw)
    loop = SpeculativeLoop(draft, target, [0], config)
    for _ in loop.rounds():
        pass
    return [0, *loop.generated], loop.stats


def kernel_after_transform(probs, params: SamplingParams) -> np.ndarray:
    logits = torch.log(torch.tensor(probs, dtype=torch.float32))
    return probs_from_logits(logits, params).double().numpy()


@pytest.mark.slow
@pytest.mark.parametrize(
    "vocab,k,sampling",
    [
        (8, 3, SamplingParams(temperature=1.0)),
        (8, 1, SamplingParams(temperature=0.7, top_k=5)),
        (50, 4, SamplingParams(temperature=1.3, top_p=0.9)),
    ],
)
def test_loop_preserves_target_distribution(vocab, k, sampling):
    target_probs, draft_probs = random_markov(vocab, 11), random_markov(vocab, 12)
    draft, target, draft_engine, target_engine = pair(target_probs, draft_probs)
    tokens, stats = run(draft, target, sampling, k, N_TOKENS, seed=5)
    assert len(tokens) == N_TOKENS + 1
    params = sampling
    assert markov_chisquare(tokens, kernel_after_transform(target_probs, params)) > 1e-3
    assert markov_chisquare(tokens, kernel_after_transform(draft_probs, params)) < 1e-3
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # rejections happened
    assert draft_engine.open_sessions == target_engine.open_sessions == 0


def test_loop_sampling_is_reproducible():
    draft, target, *_ = pair(random_markov(8, 1), random_markov(8, 2))
    sampling = SamplingParams(temperature=1.0)
    a, _ = run(draft, target, sampling, 3, 300, seed=7)
    b, _ = run(draft, target, sampling, 3, 300, seed=7)
    c, _ = run(draft, target, sampling, 3, 300, seed=8)
    assert a == b and a != c


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.usefixtures("draft_awaited")
def test_loop_greedy_is_target_argmax_chain(k):
    target_probs, draft_probs = random_markov(20, 3), random_markov(20, 4)
    draft, target, *_ = pair(target_probs, draft_probs)
    tokens, stats = run(draft, target, SamplingParams(), k, 200, seed=0)
    assert tokens == argmax_chain(target_probs, 200)
    assert stats.draft_tokens > 0


@pytest.mark.usefixtures("draft_awaited")
def test_only_a_sample_makes_a_generator_and_each_generation_has_sessions_of_its_own():
    """Greedy and the invariant rule draw nothing: their generator is never made (~30 µs a request on
    the scheduler's thread under load); a Leviathan sample makes it. Every generation's sessions have
    an id of their own, and a forked process draws ids of its own (they share the services)."""
    draft, target, *_ = pair(random_markov(8, 5), random_markov(8, 6))
    loops = []
    for sampling, rule in [(SamplingParams(), "leviathan"), (SamplingParams(temperature=1.0), "invariant"),
                           (SamplingParams(temperature=1.0), "leviathan")]:  # fmt: skip
        config = LoopConfig(sampling=sampling, max_new_tokens=20, lookahead=3, seed=1, rule=rule)
        loops.append(SpeculativeLoop(draft, target, [0], config))
        for _ in loops[-1].rounds():
            pass
        assert loops[-1].stats.draft_tokens > 0
    assert ["rng" in vars(loop) for loop in loops] == [False, False, True]
    assert len({loop.session_id for loop in loops}) == 3
    read, write = os.pipe()
    if (pid := os.fork()) == 0:  # the child: its first id, then out
        os.write(write, new_session_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    for fd in (read, write):
        os.close(fd)
    assert child[:16] != new_session_id()[:16] == loops[0].session_id[:16]


@pytest.mark.slow
def test_target_only_matches_distribution(monkeypatch):
    """The Leviathan rule, speculation off: PLAIN_STEPS tokens a Score, each sampled on the target
    with its plain round's draws, so a seed gives the same text as one step a Score; the law is the
    target's."""
    target_probs = random_markov(8, 21)
    draft, target, *_ = pair(target_probs, random_markov(8, 22))
    sampling = SamplingParams(temperature=1.0)
    tokens, stats = run(draft, target, sampling, 4, 20_000, seed=1, speculate=False)
    assert stats.draft_tokens == 0 and stats.rounds <= 1 + math.ceil(19_999 / PLAIN_STEPS)
    assert markov_chisquare(tokens, target_probs) > 1e-3
    several, _ = run(draft, target, sampling, 4, 300, seed=2, speculate=False)
    one_step_a_score(monkeypatch)
    one, stats = run(draft, target, sampling, 4, 300, seed=2, speculate=False)
    assert stats.rounds == 300 and several == one


def argmax_chain(target_probs, n_tokens):
    chain = [0]
    while len(chain) < n_tokens + 1:
        chain.append(int(np.argmax(target_probs[chain[-1]])))
    return chain


def one_step_a_score(monkeypatch) -> None:
    monkeypatch.setattr(plain_rounds, "PLAIN_STEPS", 1)
    monkeypatch.setattr(plain_rounds, "MAX_PLAIN_STEPS", 1)


def test_decode_steps_keep_the_round_overhead_small():
    """Steps a Score from what a generation's decode rounds measured: the overhead within 5% of the
    compute, between PLAIN_STEPS and MAX_PLAIN_STEPS."""
    assert decode_steps(0.002, 0.025) == PLAIN_STEPS  # a CPU: 2 ms a round, a 25 ms step
    assert decode_steps(0.0022, 0.0038) == 12  # a GPU's 4 ms step
    assert decode_steps(0.002, 0.00001) == decode_steps(0.001, 0.0) == MAX_PLAIN_STEPS
    assert decode_steps(0.0, 0.001) == decode_steps(-0.001, 0.001) == PLAIN_STEPS


def test_target_only_runs_several_steps_a_score_greedy(monkeypatch):
    """Speculation off, greedy: several one-token steps of the target a Score, as many as the rounds
    measured pay for, the target's argmax chain all the same, and a stop token in the middle of a
    Score's steps ends the output."""
    target_probs = random_markov(20, 3)
    draft, target, _, target_engine = pair(target_probs, random_markov(20, 4))
    tokens, stats = run(draft, target, SamplingParams(), 4, 201, seed=0, speculate=False)
    assert tokens == argmax_chain(target_probs, 201)
    # the stand-in's steps cost little beside the RPC: past the first PLAIN_STEPS, more steps a Score
    # (up to MAX_PLAIN_STEPS: 14 rounds on a quiet machine, 17 on a loaded CI worker, stop 78)
    assert 1 + math.ceil(200 / MAX_PLAIN_STEPS) <= stats.rounds < 1 + 200 // PLAIN_STEPS
    monkeypatch.setattr(plain_rounds, "MAX_PLAIN_STEPS", PLAIN_STEPS)
    tokens, stats = run(draft, target, SamplingParams(), 4, 201, seed=0, speculate=False)
    assert stats.rounds == 1 + 200 // PLAIN_STEPS  # the first token alone, then PLAIN_STEPS a round
    chain = argmax_chain(target_probs, 40)
    stop = next(t for i, t in enumerate(chain[3:], 3) if t not in chain[:i] and (i - 2) % PLAIN_STEPS)
    stops = frozenset({stop})
    tokens, _ = run(draft, target, SamplingParams(), 4, 40, seed=0, speculate=False, stop_token_ids=stops)
    assert tokens == chain[: chain.index(stop)]
    assert target_engine.open_sessions == 0


def test_an_answer_read_at_its_end_runs_longer_target_only_rounds(monkeypatch):
    """Speculation off, a unary call without stop strings (LoopConfig.streamed False): MAX_UNARY_STEPS
    steps a Score from the first round on (no token streams alone); streamed, several a Score,
    adaptive lookahead asked or not; greedy, the target's argmax chain; the Leviathan rule, a seed's
    text as the streamed rounds' and as one step a Score (each step takes its plain round's draws)."""
    target_probs = random_markov(20, 3)
    draft, target, _, target_engine = pair(target_probs, random_markov(20, 4))
    tokens, stats = run(draft, target, SamplingParams(), 4, 201, seed=0, speculate=False, streamed=False)
    assert tokens == argmax_chain(target_probs, 201)
    assert stats.rounds == math.ceil(201 / MAX_UNARY_STEPS)
    # adaptive lookahead (a server's --adaptive) with speculation off has no k to choose: it ran 201 rounds
    adaptive, adaptive_stats = run(draft, target, SamplingParams(), 4, 201, seed=0, speculate=False, adaptive=True)
    assert adaptive == tokens and adaptive_stats.rounds <= 1 + 200 // PLAIN_STEPS
    _, streamed = run(draft, target, SamplingParams(), 4, 201, seed=0, speculate=False)
    assert streamed.rounds >= 1 + math.ceil((201 - 1) / MAX_PLAIN_STEPS) > stats.rounds
    sampling = SamplingParams(temperature=1.0)
    unary, stats = run(draft, target, sampling, 4, 150, seed=2, speculate=False, streamed=False)
    assert stats.rounds == math.ceil(150 / MAX_UNARY_STEPS)
    several, _ = run(draft, target, sampling, 4, 150, seed=2, speculate=False)
    one_step_a_score(monkeypatch)
    one, _ = run(draft, target, sampling, 4, 150, seed=2, speculate=False)
    assert unary == several == one
    assert target_engine.open_sessions == 0


@pytest.mark.slow
def test_target_only_invariant_rule_is_unchanged_by_steps_a_score(monkeypatch):
    """The invariant rule, speculation off: the target samples PLAIN_STEPS tokens a Score with the
    noise of their positions, so a seed gives the same text one step a Score, several, or with
    speculation; and its law is the target's."""
    target_probs = random_markov(8, 21)
    draft, target, *_ = pair(target_probs, random_markov(8, 22))
    sampling = SamplingParams(temperature=1.0)
    several, stats = run(draft, target, sampling, 4, 300, seed=3, speculate=False, rule="invariant")
    assert stats.rounds < 300
    speculating, _ = run(draft, target, sampling, 3, 300, seed=3, rule="invariant")
    one_step_a_score(monkeypatch)
    one, stats = run(draft, target, sampling, 4, 300, seed=3, speculate=False, rule="invariant")
    assert stats.rounds == 300
    assert several == one == speculating
    monkeypatch.undo()
    tokens, _ = run(draft, target, sampling, 4, N_TOKENS, seed=9, speculate=False, rule="invariant")
    assert markov_chisquare(tokens, target_probs) > 1e-3
