"""The suffix drafter (draft_service.suffix) and the hybrid one: the index's matches and its store,
the drafters as the draft service runs them (sessions, rows, the model beside the index)."""

from __future__ import annotations

import gc
import math
import time

import numpy as np
import pytest
import torch

from draft_service import METHODS, drafters, ngram, suffix
from draft_service.drafters import make, suffix_drafter
from draft_service.proposer import proposal_row
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.session import Session
from specdec.weights.models import ModelSpec

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


def test_a_prediction_drafts_the_answer_from_its_first_round():
    """A request's prediction (Session.prediction: OpenAI's predicted output) is searched after the
    prompt's end: the answer's first round, whose suffix is the prompt's, proposes the prediction's
    start, and a later round where the answer left it and came back continues it."""
    prompt, predicted = [7, 8, 9, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    index = suffix.SuffixDrafter()
    session = Session(tokens=list(prompt), cache=None, prompt_length=len(prompt), prediction=tuple(predicted))
    assert index.suggest(session, [], 8).tokens == predicted[:8]  # a match of the prompt's 4 last tokens
    assert index.suggest(Session(tokens=list(prompt), cache=None, prompt_length=4), [], 8).tokens == []  # none
    session.tokens += [40, 41, 99, 44, 45]  # the answer changed one token, then copies again
    assert index.suggest(session, [], 4).tokens == [46, 47, 48, 49]
    assert index.suggest(session, [46, 47, 48, 49], 4).tokens == []  # the prediction ends: nothing past it
    # the session's own text wins a tie of equal matches (the prediction ranks after it)
    seq = np.array([5, 44, 45, 60, 1, 44, 45], np.int32)
    assert suffix.suggest(seq, None, 1, prediction=np.array(predicted, np.int32)).tokens == [60]


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
    def catch_up(session, window=None):  # the model's cache: nothing to feed
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
