"""The suffix and hybrid drafters through the loop on Markov stand-ins: greedy and the invariant
rule equal the target alone, the Leviathan rule's law is the target's, the hybrid's rounds and prefills."""

from __future__ import annotations

import pytest

from draft_service import suffix
from draft_service.drafters import Drafter, suffix_drafter
from draft_service.proposer import proposal_row
from draft_service.server import DraftServicer
from orchestrator.loop import FREE_START, LoopConfig, SpeculativeLoop
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.engine import SessionEngine
from specdec.runtime.session import SessionCall
from specdec.validation import MAX_LOOKAHEAD
from target_service.server import TargetServicer
from tests.standins import Direct, MarkovBackend, random_markov
from tests.stats import markov_chisquare

# -- through the loop, on Markov stand-ins ------------------------------------------------------


def hybrid(match: int = 2, rate: float = 0.0, catch_up: int = suffix.CATCH_UP) -> Drafter:
    """A hybrid whose index proposes on any match of `match` tokens (rate 0: whatever its share):
    rounds of both kinds, mixed (`catch_up` 1: and the index's weak matches and rounds without
    drafts while the model lacks more tokens than rounds since a strong match)."""
    index = suffix.HybridDrafter(match=match, rate=rate, catch_up=catch_up)
    return Drafter(index.propose, proposal_row, index.propose_tree, free=True, prefill_at_open=0)


def loop_pair(target_probs, draft_probs, drafter: Drafter):
    target = TargetServicer(SessionEngine(MarkovBackend(target_probs), "target"))
    draft = DraftServicer(SessionEngine(MarkovBackend(draft_probs), "draft"), drafter)
    return Direct(draft), Direct(target)


def run(draft, target, sampling, n, seed=3, **config):
    config = {"history_scope": "markov", **config}  # one client: its sessions draft from each other's
    loop = SpeculativeLoop(draft, target, [0, 1, 2], LoopConfig(sampling, n, seed=seed, **config))
    kinds = [r.proposed for r in loop.rounds()]
    return loop.generated, loop.stats, kinds


SCHEDULES = [
    {"lookahead": 4},
    {"lookahead": 4, "overlap": True},
    {"lookahead": 6, "adaptive": True},
    {"lookahead": 2, "free_lookahead": 16},  # a request that names no lookahead: the index sizes its chains
    {"lookahead": 2, "free_lookahead": 16, "overlap": True},
]


def drafter_of(kind: str) -> Drafter:
    return {"suffix": suffix_drafter, "hybrid": hybrid, "renting": lambda: hybrid(match=4, catch_up=1)}[kind]()


@pytest.mark.parametrize("kind", ["suffix", "hybrid", "renting"])
@pytest.mark.usefixtures("draft_awaited")
def test_greedy_and_the_invariant_rule_equal_the_target_alone(kind):
    target_probs = random_markov(12, 31, alpha=0.3)
    draft, target = loop_pair(target_probs, random_markov(12, 32), drafter_of(kind))
    plain, _, _ = run(draft, target, SamplingParams(), 200, speculate=False)
    sampling = SamplingParams(temperature=0.8)
    alone, _, _ = run(draft, target, sampling, 200, seed=5, speculate=False, rule="invariant")
    for schedule in SCHEDULES:
        out, stats, proposed = run(draft, target, SamplingParams(), 200, **schedule)
        assert out == plain, schedule
        assert "adaptive" in schedule or stats.accepted_tokens > 0, schedule
        if "free_lookahead" in schedule:  # index chains longer than k
            assert max(proposed) > schedule["lookahead"], (schedule, proposed)
        out, stats, _ = run(draft, target, sampling, 200, seed=5, rule="invariant", **schedule)
        assert out == alone, schedule
    assert draft.servicer.engine.open_sessions == 0


@pytest.mark.usefixtures("draft_awaited")
def test_index_chains_run_past_free_start_only_after_one_accepted_whole():
    """free_lookahead is the most an index chain holds: FREE_START at first and after a chain the
    target cut short, the request's whole free_lookahead after a chain accepted whole (copying)."""
    target_probs = random_markov(12, 31, alpha=0.3)
    asked = []  # the free_lookahead of each Propose
    index = suffix_drafter()

    def propose(engine, session, k, *args, free=0):
        asked.append(free)
        return index.propose(engine, session, k, *args, free=free)

    drafter = Drafter(propose, proposal_row, index.propose_tree, free=True)
    draft, target = loop_pair(target_probs, random_markov(12, 32), drafter)
    # greedy text here loops (every chain accepted whole); a sample under the invariant rule also misses
    sampling, rule = SamplingParams(temperature=0.5), "invariant"
    config = LoopConfig(sampling, 400, seed=4, lookahead=2, free_lookahead=MAX_LOOKAHEAD, rule=rule)
    loop = SpeculativeLoop(draft, target, [0, 1, 2], config)
    first, *rounds = loop.rounds()  # the first token alone, then each round after its Propose
    alone, _, _ = run(draft, target, sampling, 400, seed=4, speculate=False, rule=rule)
    assert loop.generated == alone and len(asked) == len(rounds)
    assert asked[0] == FREE_START and MAX_LOOKAHEAD in asked
    wanted, done = FREE_START, len(first.token_ids)
    for before, free in zip(rounds, asked[1:], strict=False):
        done += len(before.token_ids)
        if before.proposed:  # a round the index found no match for leaves it as it was
            wanted = MAX_LOOKAHEAD if before.accepted == before.proposed else FREE_START
        room = 400 - done - 1  # near the end, what is left
        assert free == (min(wanted, room) if room > 2 else 0), (before, free)
    assert any(0 < r.accepted < r.proposed for r in rounds)  # chains cut short too


@pytest.mark.parametrize("kind,overlap,n", [("suffix", False, 6000), ("hybrid", True, 8000), ("renting", True, 8000)])
def test_the_leviathan_rules_law_is_the_targets(kind, overlap, n):
    """Point-mass drafts (and, hybrid, rounds of the model's drafts between them, their rows
    read from the round that proposed, and rounds without drafts) keep the target's law:
    chi-square over transitions."""
    target_probs = random_markov(6, 41, alpha=0.3)  # peaked rows: n-grams repeat often
    draft, target = loop_pair(target_probs, random_markov(6, 42), drafter_of(kind))
    tokens, stats, proposed = run(draft, target, SamplingParams(temperature=1.0), n, lookahead=4, overlap=overlap)
    if kind == "renting":  # rounds of all three kinds
        assert 0 in proposed and stats.index_proposals < stats.proposals, (stats.index_proposals, stats.proposals)
    assert markov_chisquare([2, *tokens], target_probs) > 1e-3
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def counting_backend(steps: list[int]) -> MarkovBackend:
    """A Markov draft that appends the tokens each forward feeds to `steps`."""
    backend = MarkovBackend(random_markov(12, 32))
    forward = backend.forward

    def counting(cache, token_ids, n_logits):
        steps.append(len(token_ids))
        return forward(cache, token_ids, n_logits)

    backend.forward = counting
    return backend


@pytest.mark.usefixtures("draft_awaited")
def test_hybrid_rounds_are_the_index_s_or_the_model_s():
    """A hybrid proposal is the index's continuation (no model step) where the match is strong, the
    model's otherwise; the model's cache catches up on what the index's rounds committed."""
    target_probs = random_markov(12, 31, alpha=0.3)
    steps = []
    engine = SessionEngine(counting_backend(steps), "draft")
    target = Direct(TargetServicer(SessionEngine(MarkovBackend(target_probs), "target")))
    draft = Direct(DraftServicer(engine, hybrid(match=3)))
    out, stats, _ = run(draft, target, SamplingParams(), 300, lookahead=4)
    plain, _, _ = run(draft, target, SamplingParams(), 300, speculate=False)
    assert out == plain and stats.accepted_tokens > 0
    # Greedy rounds go without the draft while its session opens, so whether the model proposes
    # before the index's matches turn strong depends on timing; a Leviathan sample at a fixed k
    # waits for it (orchestrator.sessions: _waits_for_draft).
    steps.clear()
    _, stats, ks = run(draft, target, SamplingParams(temperature=1.0), 300, lookahead=4)
    assert stats.accepted_tokens > 0
    assert steps and len(steps) < sum(ks)  # model rounds, and rounds that ran no model step
    assert max(steps) <= engine.prefill_chunk + 1 + 4  # a catch-up feeds in chunks


def test_a_hybrid_session_opens_without_the_model_s_prefill():
    """The hybrid's sessions open without a forward (an index round needs none); a model round
    first feeds what the cache lacks, in the chunks a prompt's prefill feeds."""
    steps = []
    engine = SessionEngine(counting_backend(steps), "draft")
    DraftServicer(engine, hybrid())
    engine.start()
    try:
        prompt = [i % 12 for i in range(300)]
        assert engine.open("s", prompt) == 300 and steps == []
        engine.run_call(SessionCall("s", None, engine.catch_up))
        chunk = engine.prefill_chunk
        assert steps == [chunk, chunk, 299 - 2 * chunk]  # all but the last token, which the next forward feeds
        engine.run_call(SessionCall("s", None, lambda session: (yield engine.forward(session, [], 1))))
        assert steps[3:] == [1]

        def continuation(session):  # drafts fed past the committed tokens (a continuation's), then a catch-up
            yield engine.forward(session, [5, 6], 1)
            held = list(session.cached)
            yield from engine.catch_up(session)
            return held, list(session.cached)

        held, after = engine.run_call(SessionCall("s", None, continuation))
        assert held == prompt + [5, 6] and after == held  # the drafts stay: a model continuation's next step needs them
        engine.close("s")
    finally:
        engine.stop()


def test_the_hybrid_prefills_a_short_prompt_at_open():
    """A prompt of at most PREFILL_AT_OPEN tokens (a chat's) is prefilled when the session opens, as
    a model drafter's is: the model drafts such text, and its catch-up would cost rounds; a longer
    one (a copy's) opens without it."""
    steps = []
    engine = SessionEngine(counting_backend(steps), "draft")
    DraftServicer(engine, suffix_drafter(hybrid=True))
    engine.start()
    try:
        assert engine.open("short", [i % 12 for i in range(suffix.PREFILL_AT_OPEN)]) == suffix.PREFILL_AT_OPEN
        assert sum(steps) == suffix.PREFILL_AT_OPEN - 1  # all but the last token, which the next forward feeds
        steps.clear()
        engine.open("long", [i % 12 for i in range(suffix.PREFILL_AT_OPEN + 1)])
        assert steps == []
        engine.close("short")
        engine.close("long")
    finally:
        engine.stop()


def test_a_session_opened_without_its_prefill_takes_no_other_cache_s_positions():
    """The hybrid's rounds depend on what its model's cache lacks: a long prompt opened without its
    prefill starts from nothing even where the prefix cache holds it, so a seed's second run makes
    the rounds its first did (with the prefix hit it lacked less, rented fewer rounds, drafted
    other tokens, and a Leviathan sample's text changed). A short prompt still starts from a hit."""
    engine = SessionEngine(counting_backend([]), "draft")
    DraftServicer(engine, suffix_drafter(hybrid=True))
    engine.start()
    try:
        for n in (suffix.PREFILL_AT_OPEN + 200, suffix.PREFILL_AT_OPEN):  # past a prefill chunk: caught up
            prompt = [i % 12 for i in range(n)]
            engine.open("first", prompt)
            engine.run_call(SessionCall("first", None, engine.catch_up))  # fed what it lacked, as a model round
            engine.close("first")  # kept by the prefix cache
            engine.open("again", prompt)
            again = len(engine._get("again").cached)
            assert again == (0 if n > suffix.PREFILL_AT_OPEN else n - 1), (n, again)
            engine.close("again")
    finally:
        engine.stop()
