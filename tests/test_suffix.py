"""The suffix drafter (draft_service.suffix) and the hybrid one: the index's matches and its store,
exactness through the loop (greedy, the invariant rule, the Leviathan rule's law) and through the
three services on loopback."""

from __future__ import annotations

import contextlib
import gc
import math
import time

import grpc
import numpy as np
import pytest
import torch

from draft_service import METHODS, drafters, ngram, suffix
from draft_service.drafters import Drafter, make, suffix_drafter
from draft_service.ngram import TokenizerBackend
from draft_service.proposer import proposal_row
from draft_service.server import DraftServicer
from draft_service.server import serve as serve_draft
from orchestrator.generation import RequestDefaults
from orchestrator.loop import FREE_START, LoopConfig, SpeculativeLoop
from orchestrator.server import connect
from orchestrator.server import serve as serve_orchestrator
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.engine import SessionEngine
from specdec.runtime.session import Session, SessionCall
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.validation import MAX_LOOKAHEAD
from specdec.weights.models import ModelSpec
from target_service.server import TargetServicer
from target_service.server import serve as serve_target
from tests.conftest import make_tokenizer
from tests.standins import Direct, MarkovBackend, random_markov
from tests.stats import markov_chisquare

# -- the index ------------------------------------------------------------------------------------


def test_the_longest_match_and_its_occurrences():
    seq = np.array([1, 2, 3, 9, 7, 2, 3, 5, 1, 2, 3], np.int32)
    m, after = suffix.occurrences(seq, seq.size - 1, seq)
    assert m == 3 and after.tolist() == [3]  # [1, 2, 3] once before; [2, 3] twice
    m, after = suffix.occurrences(seq, seq.size - 1, seq, max_match=2)
    assert m == 2 and after.tolist() == [3, 7]
    assert suffix.occurrences(seq, seq.size - 1, np.array([4], np.int32))[0] == 0
    assert suffix.suggest(seq, None, 4).tokens == [9, 7, 2, 3]
    assert suffix.suggest(np.array([1, 2, 3], np.int32), None, 4).tokens == []  # nothing repeats


def test_the_continuation_is_the_most_frequent_and_stops_where_they_disagree():
    # [5, 6] four times before the end (each after a different token): then 7 8 1, 7 8 2, 7 9, 4
    seq = [5, 6, 7, 8, 1, 5, 6, 7, 8, 2, 5, 6, 7, 9, 3, 5, 6, 4, 10, 5, 6]
    found = suffix.suggest(np.array(seq, np.int32), None, 8)
    assert found.match == 2 and found.tokens == [7, 8, 2, 5]  # at most 2 * 2 tokens
    # 7: 3 of 4; 8: 2 of the 3 left; 1 or 2: an even split, the more recent wins; then one left
    assert found.support == [3, 2, 1, 1] and found.seen == [4, 3, 2, 1]
    assert suffix.suggest(np.array([7, 3, 1, 7, 3, 2, 7, 3], np.int32), None, 4).tokens == [2, 7, 3]
    # a three-way split, each under MIN_SHARE: nothing
    assert suffix.suggest(np.array([7, 3, 1, 7, 3, 2, 7, 3, 4, 7, 3], np.int32), None, 4).tokens == []


def test_a_proposals_length_follows_its_match():
    seq = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1], np.int32)
    assert suffix.suggest(seq, None, 8).tokens == [2, 3]  # a match of 1: at most 2 tokens
    seq = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3], np.int32)
    assert suffix.suggest(seq, None, 8).tokens == [4, 5, 6, 7, 8, 9]  # of 3: 6
    assert suffix.suggest(seq, None, 4).tokens == [4, 5, 6, 7]  # capped by k


def test_the_store_evicts_the_oldest_past_its_budget():
    gc.collect()  # other tests' stores: gone before the count
    store = suffix.Store(budget=100, sessions=3)
    before = suffix.store_tokens()
    store.add(range(40))
    store.add(range(100, 140))
    assert store.tokens == 80 and len(store) == 2 and suffix.store_tokens() == before + 80
    store.add(range(200, 240))  # 120 > 100: the first goes
    assert store.tokens == 80 and store.buffer()[1] == 100
    store.add(range(300, 310))
    store.add(range(400, 410))  # a fourth: over 3 sessions
    assert len(store) == 3 and store.tokens == 60 and store.buffer()[1] == 200
    store.add(range(1000, 1500))  # longer than the budget: its last 100 tokens
    assert len(store) == 1 and store.tokens == 100 and store.buffer()[1] == 1400
    buffer = store.buffer()
    assert buffer[0] == buffer[-1] == suffix.SEPARATOR and buffer.size == 102


def test_stores_keep_each_scope_apart_within_one_bound():
    """A session drafts from its own scope's store only, one without a scope from none; 1,000
    requests of 100 clients stay within the one budget, the least recently used scope's oldest
    sequences evicted first."""
    stores = suffix.Stores(budget=1000, sessions=50)
    stores.add("alice", range(10))
    stores.add("", range(100, 110))  # no scope: kept nowhere
    assert stores.get("alice").tokens == 10 and stores.get("bob") is None and stores.get("") is None
    assert stores.tokens == 10 and stores.scopes() == 1
    index = suffix.SuffixDrafter(stores)
    for scope, expected in (("alice", [5, 6, 7, 8]), ("bob", []), ("", [])):
        session = Session(tokens=[40, 2, 3, 4], cache=None, history_scope=scope)
        assert index.suggest(session, [], 4).tokens == expected, scope
    rng = np.random.default_rng(0)
    for i in range(1000):
        stores.add(f"client-{i % 100}", rng.integers(0, 50, int(rng.integers(2, 60))))
        assert stores.tokens <= 1000 and len(stores) <= 50
    assert stores.get("alice") is None  # the least recently used: gone first
    assert stores.get("client-99") is not None and stores.scopes() <= 50


def test_a_proposal_from_the_store_and_from_the_prompt():
    store = suffix.Store()
    earlier = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    store.add(earlier)
    store.add([50, 51, 52])
    # a new sequence that repeats the earlier session's text
    found = suffix.suggest(np.array([7, 8, 22, 23, 24], np.int32), store.buffer(), 5)
    assert found.tokens == [25, 26, 27, 28, 29] and found.match == 3
    # it does not run past the end of a stored sequence into the next one
    assert suffix.suggest(np.array([7, 28, 29], np.int32), store.buffer(), 5).tokens == []
    # a single matched token in the store is no evidence; in the session it is
    assert suffix.suggest(np.array([7, 8, 24], np.int32), store.buffer(), 5).tokens == []
    # the session's own prompt: at an equal match, pooled (a tie: the more recent, the session's)
    seq = np.array([22, 23, 24, 40, 41, 9, 22, 23, 24], np.int32)
    assert suffix.suggest(seq, store.buffer(), 2).tokens == [40, 41]
    seq = np.array([9, 22, 23, 24, 40, 41, 9, 22, 23, 24], np.int32)
    assert suffix.suggest(seq, store.buffer(), 2).tokens == [40, 41]  # the session's match is longer (4)
    seq = np.array([9, 22, 23, 24, 40, 41, 20, 21, 22, 23, 24], np.int32)
    assert suffix.suggest(seq, store.buffer(), 2).tokens == [25, 26]  # the store's is (5)


def test_a_proposal_costs_well_under_a_millisecond():
    rng = np.random.default_rng(0)
    store = suffix.Store()
    for _ in range(64):
        store.add(rng.integers(0, 5000, 4096))
    assert store.tokens == suffix.STORE_TOKENS
    sequence = rng.integers(0, 5000, 4000).astype(np.int32)
    sequence = np.concatenate([sequence, sequence[100:120]])
    buffer = store.buffer()
    best = float("inf")
    for _ in range(10):  # the fastest of 10: a loaded machine's other work is not the proposal's cost
        start = time.perf_counter()
        found = suffix.suggest(sequence, buffer, 8)
        best = min(best, time.perf_counter() - start)
    assert found.tokens == sequence[120:128].tolist()
    assert best < 1e-3, best


class _Engine:
    class backend:  # noqa: N801
        vocab_size = 64

    @staticmethod
    def catch_up(session):  # the model's cache: nothing to feed
        return iter(())


def test_closed_sessions_enter_the_store_and_rows_are_point_masses():
    index = suffix.SuffixDrafter()
    first = Session(tokens=[1, 2, 3, 4, 5, 6, 7, 8], cache=None, history_scope="a")
    greedy, sampling = SamplingParams(), SamplingParams(temperature=0.8)
    assert index.propose(_Engine, first, 4, greedy, []) == ([], [])
    first.tokens += [9, 10]
    first.closed = True  # the engine retired it
    second = Session(tokens=[30, 31, 4, 5, 6], cache=None, history_scope="a")
    drafts, probs = index.propose(_Engine, second, 4, sampling, [0.5] * 4)
    assert index.stores.tokens == 10 and drafts == [7, 8, 9, 10] and probs == [1.0] * 4
    assert proposal_row(second, 0, 7).tolist() == np.eye(64)[7].tolist()
    second.tokens += [7, 8]  # committed; then rolled back to before them and on another way
    del second.tokens[5:]
    second.tokens += [5, 6, 7]
    drafts, _ = index.propose(_Engine, second, 4, sampling, [0.5] * 4, assumed=[8])
    assert drafts == [9, 10] and proposal_row(second, 0, 8)[8] == 1.0  # the assumed one: a point mass
    assert index.propose(_Engine, second, 4, greedy, [], noise_seed=None)[1] == []
    assert second.proposal_rows is None
    del second.tokens[2:]  # rolled back, and on another way: the index follows
    second.tokens += [8, 9]
    assert index.suggest(second, [], 4).tokens == [10]


def test_a_continuation_that_finds_nothing_keeps_the_rows_of_what_it_continues():
    """An overlapped round's continuation proposes past the round's drafts (assumed); where the
    index finds nothing after them, a rejection among those drafts still reads their rows
    (ProposalRow). Before, it dropped them: a Leviathan sample failed FAILED_PRECONDITION."""
    sampling = SamplingParams(temperature=0.8)
    session = Session(tokens=[5, 6, 7, 9, 5, 6], cache=None)
    drafts, _ = suffix.SuffixDrafter().propose(_Engine, session, 2, sampling, [0.5] * 2)
    assert drafts == [7, 9]
    assert ngram.point_masses(_Engine, session, sampling, None, drafts, []) == ([], [])
    assert proposal_row(session, 1, 9).tolist() == np.eye(64)[9].tolist()
    model_row = np.full(64, 1 / 64)  # a hybrid's model round drew the assumed token: its row is kept
    session.proposal_rows, session.proposal_tokens = torch.tensor(model_row)[None], [3]
    ngram.point_masses(_Engine, session, sampling, None, [3], [4])
    assert proposal_row(session, 0, 3).tolist() == pytest.approx(model_row.tolist())
    assert proposal_row(session, 1, 4)[4] == 1.0


def test_registered():
    assert {"suffix", "hybrid"} <= set(METHODS)
    with pytest.raises(ValueError):
        make("suffixes", None)


def test_hybrid_leaves_an_index_that_misses_to_the_model(monkeypatch):
    """The hybrid's index proposes only while its strong proposals of the session have lately
    matched what was committed; scored whether used or not, it takes over again on a copy."""

    def model(engine, session, k, *rest):
        return [99], [1.0]
        yield  # a generator, as proposer.propose

    monkeypatch.setattr(suffix.proposer, "propose", model)
    index = suffix.HybridDrafter(match=2)
    session = Session(tokens=list(range(100, 300)), cache=None)  # a text each round copies a bit of
    greedy = SamplingParams()

    def round_at(j: int) -> str:
        session.tokens += [100 + j, 101 + j, 102 + j]  # a unique match of 3
        session.cached = session.tokens[:-1]  # the model keeps up (its catch-up costs nothing)
        gen = index.propose(_Engine, session, 4, greedy, [])
        with pytest.raises(StopIteration) as stop:
            next(gen)
        return "index" if stop.value.value[0] == [103 + j, 104 + j, 105 + j, 106 + j] else "model"

    who = []
    for miss in range(4):  # the text goes on otherwise each time
        who.append(round_at(10 * miss))
        session.tokens += [50 + miss]  # its first draft rejected
    assert who == ["index", "index", "model", "model"]  # its share: 1, 0.7, then 0.49 < HYBRID_RATE
    assert index._live[id(session)].rate < suffix.HYBRID_RATE
    for j in range(50, 100, 10):  # now a copy: the index's proposals (unused) match, and it comes back
        who.append(round_at(j))
        session.tokens += [103 + j, 104 + j, 105 + j, 106 + j, 107 + j]
    assert who[4:] == ["model", "model", "index", "index", "index"], who  # 0.24, 0.47, 0.63, ...


def test_hybrid_keeps_the_rounds_while_the_model_lacks_a_long_prompt(monkeypatch):
    """A model that lacks more tokens than `catch_up` for each round since the index's last strong
    match (a long prompt its session opened without) catches up only past them: until then the
    index's weak matches propose, and rounds where it finds none go without drafts (a copy's
    changed line costs less so than the catch-up). A proposal matched through its first HOLD drafts
    scores as one matched whole."""

    def model(engine, session, k, *rest):
        return [99], [1.0]
        yield  # a generator, as proposer.propose

    monkeypatch.setattr(suffix.proposer, "propose", model)
    index = suffix.HybridDrafter(match=4, catch_up=32)
    session = Session(tokens=list(range(100, 228)), cache=None)  # 128 prompt tokens, none in the model's cache

    def round_after(tokens: list[int]) -> str:
        session.tokens += tokens
        gen = index.propose(_Engine, session, 16, SamplingParams(), [])
        with pytest.raises(StopIteration) as stop:
            next(gen)
        drafts = stop.value.value[0]
        return "model" if drafts == [99] else "none" if not drafts else f"index {drafts[0]}+{len(drafts)}"

    who = [round_after(tokens) for tokens in ([500], [100, 101], [501], [502], [503])]
    # rounds since a strong match (or the start): 1..5, x 32 against the 129-134 tokens lacked
    assert who == ["none", "index 102+4", "none", "none", "model"], who
    session.cached = list(session.tokens)  # the model caught up
    assert round_after([100, 101]) == "model"  # a weak match: the model's, now that it lacks nothing
    assert round_after([102, 103, 104, 105]) == "index 106+12"  # a strong match (6): the index's
    round_after([106, 107, 108, 109, 777])  # its first 4 of 12 drafts committed, then another token
    assert index._live[id(session)].rate == 1.0


def test_a_call_made_again_gets_the_first_answer_and_changes_nothing():
    """A round re-run after a lost or late reply asks the hybrid again at the same position: the
    same answer, and its count of rounds since a strong match does not move (a Leviathan seed's text
    would otherwise depend on how often a call was sent: a chaos run's stream changed under a slow link)."""
    index = suffix.HybridDrafter(match=4, catch_up=32)
    session = Session(tokens=list(range(100, 228)) + [500], cache=None)  # lacks 129 tokens: renting
    first = index.choose(session, [], 16)
    state = index._live[id(session)]
    gap = state.gap
    assert index.choose(session, [], 16) == first and state.gap == gap
    session.tokens += [501]
    index.choose(session, [], 16)
    assert state.gap == gap + 1


def test_a_reproducible_session_drafts_as_a_function_of_its_tokens():
    """A seeded Leviathan sample's session (Session.reproducible) drafts as a session re-opened after
    a fault would (a restarted draft service: no state, its cache caught up): the index where its
    match is strong, the model elsewhere, whatever its earlier rounds left (the rounds since a strong
    match, what the model's cache lacks), where another session rents the index's rounds."""
    index = suffix.HybridDrafter(match=4, catch_up=32)
    prompt = list(range(100, 228))
    lived = Session(tokens=prompt + [500], cache=None, reproducible=True)  # lacks 129 tokens: others rent
    renting = Session(tokens=list(lived.tokens), cache=None)
    answers, rented = [], []
    for tokens in ([501], [100, 101, 102, 103], [104, 105, 999], [502]):
        lived.tokens += tokens
        renting.tokens += tokens
        answers.append(index.choose(lived, [], 16))
        rented.append(index.choose(renting, [], 16))
        reopened = Session(tokens=list(lived.tokens), cache=None, reproducible=True)
        reopened.cached = list(reopened.tokens)
        assert index.choose(reopened, [], 16) == answers[-1]
    assert answers == [None, list(range(104, 112)), None, None]  # the model's, the index's (a match of 4: 8)
    assert rented[0] == [] and rented[2] == []  # a session that is not reproducible rents: no drafts


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


def test_with_its_model_on_an_accelerator_the_hybrid_prefills_and_never_rents(monkeypatch):
    """A draft model on an accelerator prefills for far less than a round costs: the hybrid there
    prefills every prompt at open and leaves every round its index does not take to the model,
    however much the model lacks (draft_service.drafters)."""
    assert suffix_drafter(hybrid=True, accelerated=True).prefill_at_open is None
    assert suffix_drafter(hybrid=True).prefill_at_open == suffix.PREFILL_AT_OPEN
    assert drafters.accelerated(ModelSpec(device="cuda:0")) and not drafters.accelerated(ModelSpec())

    def model(engine, session, k, *rest):
        return [99], [1.0]
        yield  # a generator, as proposer.propose

    monkeypatch.setattr(suffix.proposer, "propose", model)
    index = suffix.HybridDrafter(match=4, catch_up=math.inf)
    session = Session(tokens=list(range(100, 228)), cache=None)  # 128 prompt tokens, none in the model's cache
    for tokens in ([500], [100, 101]):  # no match, then a weak one: the model's rounds
        session.tokens += tokens
        with pytest.raises(StopIteration) as stop:
            next(index.propose(_Engine, session, 16, SamplingParams(), []))
        assert stop.value.value[0] == [99]


# -- through the three services on loopback -----------------------------------------------------

REPEATING = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick"
PLAIN = "hello world, write me a short poem"
TOKENIZER = make_tokenizer()


@contextlib.contextmanager
def services(tiny_models, tiny_backends, kind: str, pair_out: list | None = None, lookahead: int | None = 4):
    """(stub, the draft's stores) of three services with the suffix or hybrid drafter, the server's
    default `lookahead`; `pair_out` gets the orchestrator's ModelPair."""
    if kind == "suffix":
        backend = TokenizerBackend(ModelSpec(tiny_models["draft"], "cpu", "float32"))
    else:
        backend = tiny_backends["draft"]
    drafter = suffix_drafter(hybrid=kind == "hybrid")
    draft_server, draft_port = serve_draft(backend, drafter=drafter)
    target_server, target_port = serve_target(tiny_backends["target"])
    pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
    if pair_out is not None:
        pair_out.append(pair)
    orch_server, orch_port = serve_orchestrator(pair, defaults=RequestDefaults(lookahead=lookahead))
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orch_port}"))
        yield stub, drafter.propose.__self__.stores
    finally:
        for server in (orch_server, draft_server, target_server):
            server.stop(None)


def request(ids, n=60, sampling=None, seed=None, rule=orchestrator_pb2.RULE_UNSPECIFIED, disabled=False, **history):
    spec = orchestrator_pb2.SpeculationParams(rule=rule, disabled=disabled, **history)
    if not disabled:
        spec.lookahead = 4
    out = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=ids),
        sampling=sampling or model_pb2.SamplingParams(),
        max_new_tokens=n,
        speculation=spec,
    )
    if seed is not None:
        out.seed = seed
    return out


def ids(text: str) -> list[int]:
    return TOKENIZER(text)["input_ids"]


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_through_the_services(tiny_models, tiny_backends, kind):
    with services(tiny_models, tiny_backends, kind) as (stub, _):
        accepted = 0
        for prompt in (REPEATING, PLAIN):
            on = stub.Generate(request(ids(prompt)))
            off = stub.Generate(request(ids(prompt), disabled=True))
            assert list(on.token_ids) == list(off.token_ids) and off.stats.draft_tokens == 0
            accepted += on.stats.accepted_tokens
        assert accepted > 0
        sampling = model_pb2.SamplingParams(temperature=0.8)
        for rule in (orchestrator_pb2.RULE_LEVIATHAN, orchestrator_pb2.RULE_INVARIANT):
            out = stub.Generate(request(ids(REPEATING), 50, sampling, seed=7, rule=rule))
            assert out.stats.generated_tokens == 50 or out.finish_reason == "stop"
            if rule == orchestrator_pb2.RULE_INVARIANT:
                alone = stub.Generate(request(ids(REPEATING), 50, sampling, seed=7, rule=rule, disabled=True))
                assert list(out.token_ids) == list(alone.token_ids)


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_the_pair_prices_a_hybrids_model_by_its_model_rounds(tiny_models, tiny_backends, kind):
    """The hybrid's index rounds (no forward; a copy's acceptance) count for the target's verify
    only: its model's drafts are priced by the model's rounds, each token a step's (PairCosts
    .index_apart; counted as the model's, 18 code requests priced the default pair's draft token
    at 0.1 ms and k = 16). The suffix drafter, an index alone, is priced by its index rounds."""
    pair = []
    with services(tiny_models, tiny_backends, kind, pair, lookahead=None) as (stub, _):
        index = 0
        for prompt in (REPEATING, PLAIN, REPEATING):
            unset = request(ids(prompt), 80)
            unset.speculation.ClearField("lookahead")  # the measured default: its rounds price the pair
            index += stub.Generate(unset).stats.index_proposals
        costs = pair[0].costs
        assert index > 0 and costs.index_apart == (kind == "hybrid")
        if kind == "hybrid":  # the drafts priced are its model's: a token a forward, none free
            assert 0 < costs.draft_tokens <= costs.draft_steps + 1e-9, (costs.draft_tokens, costs.draft_steps)
        else:
            assert costs.draft_steps == 0 and costs.draft_tokens > 0


@pytest.mark.usefixtures("draft_awaited")
def test_a_seeded_leviathan_sample_replays_its_text_without_the_store(tiny_models, tiny_backends):
    """A Leviathan sample's text depends on its drafts: drafted from the store, a seed's second run
    would draft the first one's answer and sample other text. A seeded sample neither drafts from
    the store nor enters it; a greedy request (its text the target's whatever drafts it) does."""
    sampling = model_pb2.SamplingParams(temperature=0.8)
    with services(tiny_models, tiny_backends, "suffix") as (stub, stores):
        texts = [list(stub.Generate(request(ids(PLAIN), 40, sampling, seed=7)).token_ids) for _ in range(3)]
        assert texts[0] == texts[1] == texts[2] and stores.tokens == 0
        stub.Generate(request(ids(PLAIN), 40))
        stub.Generate(request(ids(PLAIN), 40))  # its proposals enter the closed greedy session
        assert stores.tokens > 0
        for _ in range(20):  # unseeded samples draft from the store (rejections read their rows)
            out = stub.Generate(request(ids(PLAIN), 40, sampling))
            assert out.stats.generated_tokens == 40 or out.finish_reason == "stop"


def test_only_a_seeded_leviathan_sample_opens_a_reproducible_draft_session(tiny_models, tiny_backends, monkeypatch):
    """The orchestrator asks for drafts that are a function of the tokens (OpenSessionRequest.reproducible)
    where the text depends on them and a seed must replay it: a seeded Leviathan sample; not an
    unseeded one, not a greedy one, not the invariant rule's (their texts are the target's own)."""
    seen = []
    choose = suffix.HybridDrafter.choose

    def recording(self, session, assumed, k):
        seen.append(session.reproducible)
        return choose(self, session, assumed, k)

    monkeypatch.setattr(suffix.HybridDrafter, "choose", recording)
    sampling = model_pb2.SamplingParams(temperature=0.8)
    cases = [
        (request(ids(PLAIN), 40, sampling, seed=7), True),
        (request(ids(PLAIN), 40, sampling), False),
        (request(ids(PLAIN), 40, seed=7), False),
        (request(ids(PLAIN), 40, sampling, seed=7, rule=orchestrator_pb2.RULE_INVARIANT), False),
    ]
    with services(tiny_models, tiny_backends, "hybrid") as (stub, _):
        for sent, wanted in cases:
            seen.clear()
            stub.Generate(sent)
            assert set(seen) <= {wanted}, sent
            assert seen or not wanted  # a Leviathan sample at a fixed k waits for its draft: it drafts


@pytest.mark.usefixtures("draft_awaited")
def test_a_request_that_names_no_lookahead_takes_the_index_s_chains(tiny_models, tiny_backends):
    """A greedy request that names no lookahead (nor does the server) lets the suffix drafter size its
    chains up to MAX_LOOKAHEAD (ProposeRequest.free_lookahead; FREE_START until a chain is accepted
    whole), past the k the pair prices; a Leviathan sample keeps k (its uniforms are k): the text is
    the target alone's either way."""
    asked = []  # (k, free_lookahead, tokens proposed)
    index = suffix_drafter()

    def propose(engine, session, k, *args, free=0):
        tokens, probs = index.propose(engine, session, k, *args, free=free)
        asked.append((k, free, len(tokens)))
        return tokens, probs

    backend = TokenizerBackend(ModelSpec(tiny_models["draft"], "cpu", "float32"))
    draft_server, draft_port = serve_draft(
        backend, drafter=Drafter(propose, proposal_row, index.propose_tree, free=True)
    )
    target_server, target_port = serve_target(tiny_backends["target"])
    pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
    orch_server, orch_port = serve_orchestrator(pair)
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orch_port}"))
        greedy = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=ids(REPEATING)), max_new_tokens=80
        )
        on = stub.Generate(greedy)
        off = stub.Generate(request(ids(REPEATING), 80, disabled=True))
        assert list(on.token_ids) == list(off.token_ids) and on.stats.accepted_tokens > 0
        frees = [free for _, free, _ in asked if free]
        assert frees[0] <= FREE_START and max(frees) <= MAX_LOOKAHEAD
        assert any(n > k for k, _, n in asked), asked  # chains past the priced k
        asked.clear()
        sampled = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=ids(REPEATING)),
            max_new_tokens=40,
            sampling=model_pb2.SamplingParams(temperature=0.8),
            seed=3,
        )
        stub.Generate(sampled)
        assert asked and all(free == 0 and n <= k for k, free, n in asked), asked
    finally:
        for server in (orch_server, draft_server, target_server):
            server.stop(None)


@pytest.mark.usefixtures("draft_awaited")
def test_a_resent_request_drafts_from_the_store(tiny_models, tiny_backends):
    """An agent resends its request with a little more: what the target wrote the first time,
    which the new session has not seen, is drafted from the store. (The tiny target's greedy
    text loops, which its own tokens predict: a seeded sample under the invariant rule, the same
    token at a position whatever the schedule, is text the session's own tokens do not predict.)"""
    prompt = ids("zebra")  # its sample at seed 2 meets no EOS for 150 tokens
    sampling = model_pb2.SamplingParams(temperature=1.0)
    rule = orchestrator_pb2.RULE_INVARIANT
    with services(tiny_models, tiny_backends, "suffix") as (stub, store):
        first = stub.Generate(request(prompt, 120, sampling, seed=2, rule=rule))
        resent = prompt + list(first.token_ids)[:10]
        assert store.tokens == 0
        again = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule))
        assert store.tokens >= len(prompt) + 100  # the first session entered the store
        assert list(again.token_ids) == list(first.token_ids)[10:110]
    with services(tiny_models, tiny_backends, "suffix") as (stub, _):  # an empty store
        fresh = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule))
    assert list(fresh.token_ids) == list(again.token_ids)
    assert again.stats.accepted_tokens > fresh.stats.accepted_tokens + 30, (again.stats, fresh.stats)


@pytest.mark.usefixtures("draft_awaited")
def test_earlier_answers_draft_only_the_same_clients_requests(tiny_models, tiny_backends):
    """The store is kept per client (credential and salt): the request resent under another salt
    drafts nothing from the first answer, under the same salt it does, and with history false it
    neither drafts from it nor is kept. The text is the same in all three (drafts are point masses)."""
    prompt = ids("zebra")
    sampling = model_pb2.SamplingParams(temperature=1.0)
    rule = orchestrator_pb2.RULE_INVARIANT
    with services(tiny_models, tiny_backends, "suffix") as (stub, stores):
        first = stub.Generate(request(prompt, 120, sampling, seed=2, rule=rule, history_salt="alice"))
        resent = prompt + list(first.token_ids)[:10]
        other = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule, history_salt="bob"))
        same = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule, history_salt="alice"))
        off = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule, history_salt="alice", history=False))
        kept = stores.tokens
        stub.Generate(request(resent, 10, sampling, seed=2, rule=rule, history=False))
        assert stores.tokens == kept and stores.scopes() == 2  # alice and bob; nothing from the opted out
    texts = [list(r.token_ids) for r in (other, same, off)]
    assert texts[0] == texts[1] == texts[2] == list(first.token_ids)[10:110]
    for without in (other, off):
        assert same.stats.accepted_tokens > without.stats.accepted_tokens + 30, (same.stats, without.stats)


def test_history_scope_names_the_client_and_the_salt():
    """orchestrator.server.client_identity: a verified client certificate tells clients apart, a
    bearer token does not (one for all); the scope a digest of it and the salt; "" when opted out."""
    from orchestrator.generation import history_scope
    from orchestrator.server import client_identity

    class Context:
        def __init__(self, auth):
            self.auth = auth

        def auth_context(self):
            return self.auth

    a, b = (client_identity(Context({"x509_pem_cert": [pem]})) for pem in (b"PEM A", b"PEM B"))
    anonymous = client_identity(Context({}))
    assert a != b and anonymous == "" and a.startswith("cert:")
    spec = orchestrator_pb2.SpeculationParams
    scopes = {history_scope(who, spec(history_salt=salt)) for who in (a, b, anonymous) for salt in ("", "x")}
    assert len(scopes) == 6 and "" not in scopes
    assert history_scope(a, spec(history=True)) == history_scope(a, spec())
    assert history_scope(a, spec(history=False, history_salt="x")) == ""
