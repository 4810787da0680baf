"""Overlapped rounds: while the target verifies round r, the draft proposes round r + 1 as if
all of r were accepted. The output must not change: greedy equal to target-only decoding for
every drafter and k, sampling distributed as the target (chi-square, with the same test
rejecting the draft's law), a seed reproducing a generation, and a restarted service during
overlapped rounds leaving the output as it was (tests/test_recovery.py runs that one)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from draft_service.drafters import MODEL, NGRAM
from draft_service.server import DraftServicer
from orchestrator.lookahead import AdaptiveLookahead, RoundCosts, best_lookahead, round_time
from orchestrator.loop import RUNNING, LoopConfig, SpeculativeLoop
from orchestrator.pair_costs import DraftCost, PairCosts, RoundReport, Sharing, profiled
from orchestrator.plain_rounds import MAX_UNARY_STEPS, PLAIN_STEPS
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.engine import SessionEngine
from target_service.server import TargetServicer
from tests.harness import wait_until
from tests.standins import Direct, MarkovBackend, draft_opens_first, random_markov
from tests.stats import counts_chisquare, markov_chisquare, transition_counts

DRAFTERS = {"model": MODEL, "ngram": NGRAM}


def pair(target_probs, draft_probs, drafter="model"):
    target = TargetServicer(SessionEngine(MarkovBackend(target_probs), "target"))
    draft = DraftServicer(SessionEngine(MarkovBackend(draft_probs), "draft"), DRAFTERS[drafter])
    return Direct(draft), Direct(target)


def near(target_probs, seed: int, weight: float = 0.3):
    """A draft law close to the target's: its argmax agrees on most rows, not all."""
    return (1 - weight) * target_probs + weight * random_markov(target_probs.shape[0], seed)


def run(draft, target, sampling, n, k=4, overlap=True, speculate=True, seed=3, adaptive=False):
    config = LoopConfig(sampling, n, lookahead=k, speculate=speculate, seed=seed, overlap=overlap, adaptive=adaptive)
    loop = SpeculativeLoop(draft, target, [0, 1, 2], config)
    for _ in loop.rounds():
        pass
    return loop.generated, loop.stats


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.usefixtures("draft_awaited")
def test_greedy_equals_target_only(drafter, k):
    target_probs = random_markov(12, 31, alpha=0.2)  # peaked rows: long accepted runs
    draft, target = pair(target_probs, near(target_probs, 32), drafter)
    greedy = SamplingParams()
    plain, _ = run(draft, target, greedy, 200, speculate=False)
    spec, stats = run(*draft_opens_first(draft, target), greedy, 200, k=k)
    assert spec == plain and stats.draft_tokens > 0
    if drafter == "model":  # n-gram lookup often finds too few tokens to carry any over
        assert stats.overlapped_rounds > 0  # continuations were used, not only proposed


def test_greedy_equals_target_only_with_adaptive_lookahead():
    target_probs = random_markov(12, 33, alpha=0.2)
    draft, target = pair(target_probs, target_probs)  # the same law: every draft accepted
    plain, _ = run(draft, target, SamplingParams(), 120, speculate=False)
    spec, stats = run(*draft_opens_first(draft, target), SamplingParams(), 120, k=6, adaptive=True)
    assert spec == plain and stats.overlapped_rounds > 0
    assert stats.accepted_tokens == stats.draft_tokens  # continuations' first tokens included


def test_a_carried_round_drafts_one_token_a_step():
    """A continuation goes on from the draft's cached tail: the round's commit (the drafts it was
    proposed past, and its own first token) keeps the cache, so each of its steps feeds one
    token (the commit used to crop the cache to the committed tokens less one, and every
    carried round's first step fed the whole tail again: k + 1 tokens)."""
    target_probs = random_markov(12, 35, alpha=0.2)
    draft, target = pair(target_probs, target_probs)  # the same law: every round carried over
    proposals = []

    class Recording:
        def __getattr__(self, name):
            return getattr(draft, name)

        def Propose(self, request, timeout=None):
            response = draft.Propose(request, timeout)
            proposals.append((len(request.assumed_tokens), response))
            return response

    spec, stats = run(*draft_opens_first(Recording(), target), SamplingParams(), 60, k=4)
    continued = [r for assumed, r in proposals if assumed]
    assert stats.overlapped_rounds >= 5 and len(continued) >= 5
    # one token a step (a continuation near the end of the generation is shorter)
    assert all(r.steps == r.step_tokens for r in continued) and {r.steps for r in continued[:5]} == {5}


@pytest.mark.slow
@pytest.mark.parametrize(
    "vocab,k,sampling,drafter",
    [
        (6, 3, SamplingParams(temperature=1.0), "model"),
        (8, 2, SamplingParams(temperature=0.7, top_k=5), "model"),
        (6, 4, SamplingParams(temperature=1.0), "ngram"),
    ],
)
def test_distribution_through_overlapped_rounds(vocab, k, sampling, drafter):
    target_probs = random_markov(vocab, 41, alpha=0.3)
    draft_probs = near(target_probs, 42, weight=0.5)
    draft, target = pair(target_probs, draft_probs, drafter)
    tokens, stats = run(draft, target, sampling, 12_000, k=k, seed=11)
    kernel = target_probs if sampling.temperature == 1.0 else None
    if kernel is None:
        from tests.test_loop import kernel_after_transform

        kernel = kernel_after_transform(target_probs, sampling)
    assert markov_chisquare([2, *tokens], kernel) > 1e-3
    assert stats.overlapped_rounds > (600 if drafter == "model" else 10)
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    if drafter == "model":  # power: the same test tells the draft's law apart
        assert markov_chisquare([2, *tokens], draft_probs) < 1e-3


class CountingRows(Direct):
    """The draft stub, counting the rows the residuals fetched."""

    rows = 0

    def ProposalRow(self, request, timeout=None):
        self.rows += 1
        return self.servicer.ProposalRow(request, None)


@pytest.mark.slow
def test_distribution_of_short_overlapped_generations():
    """Generations of 7 tokens at k = 3: their ends take the paths a long chain rarely does (a
    continuation shortened or skipped for lack of room, the next round's drafts used with no
    continuation, a rejection among them). Transitions pooled over 2,000 generations. Every
    row fetched for a residual names the token it must have drawn (ProposalRowRequest.token_id),
    so a row asked for at a wrong position fails the request instead of biasing the output."""
    target_probs = random_markov(5, 61, alpha=0.4)
    draft_probs = near(target_probs, 62, weight=0.6)
    _, target = pair(target_probs, draft_probs)
    draft = CountingRows(DraftServicer(SessionEngine(MarkovBackend(draft_probs), "draft")))
    counts = np.zeros((5, 5), dtype=np.int64)
    overlapped = 0
    for seed in range(2000):
        tokens, stats = run(draft, target, SamplingParams(temperature=1.0), 7, k=3, seed=seed)
        counts += transition_counts([2, *tokens], 5)
        overlapped += stats.overlapped_rounds
    assert counts_chisquare(counts, target_probs) > 1e-3
    assert overlapped > 300 and draft.rows > 1000  # the first round of each is the target's alone


def test_seeded_overlapped_sampling_reproduces():
    draft, target = pair(random_markov(10, 51), random_markov(10, 52))
    sampling = SamplingParams(temperature=1.0)
    a, _ = run(draft, target, sampling, 400, seed=7)
    b, _ = run(draft, target, sampling, 400, seed=7)
    c, _ = run(draft, target, sampling, 400, seed=8)
    assert a == b and a != c


def best_overlapped(alpha: float, draft: float, t1: float, slope: float, k_max: int) -> int:
    """The policy's k for one generation alone, overlapped rounds allowed (chosen)."""
    k, overlapped = best_lookahead(alpha, RoundCosts(draft, (t1, slope)), t1, k_max, overlap=True)
    assert overlapped
    return k


def test_policy_makes_the_continuation_end_with_the_verify():
    """Every draft accepted: a longer round amortises the verify, so k grows until the draft's
    continuation (k + 1 steps) is as long as the verify of k drafts, and no further."""
    t1, slope, k_max = 0.060, 0.008, 16  # target: 60 ms a round, 8 ms per extra token scored
    for draft in (0.004, 0.010, 0.017, 0.040):
        balanced = next((k for k in range(1, k_max + 1) if (k + 1) * draft >= t1 + slope * k), k_max)
        assert best_overlapped(1.0, draft, t1, slope, k_max) == balanced, draft
    # Rejections waste the continuation and the fresh drafting after them: a smaller k.
    assert best_overlapped(0.6, 0.010, t1, slope, k_max) < best_overlapped(0.95, 0.010, t1, slope, k_max)


def test_adaptive_overlapped_policy_learns_from_the_rounds():
    policy = AdaptiveLookahead(k_max=16, overlap=True)
    for k in (8, 4, 8, 4, 8, 4):  # rounds of two sizes: the verify line has two points
        policy.update(RoundReport(k + 1, k + 1, draft=0.010 * (k + 1), target_seconds=0.060 + 0.008 * k))
    assert policy.next_k() == best_overlapped(1.0, 0.010, 0.060, 0.008, 16)


class SlowOpen:
    """A draft stub whose OpenSession waits for `opened` to be set (a draft busy prefilling
    others' prompts); every other call goes straight through."""

    def __init__(self, stub):
        self.stub = stub
        self.opened = threading.Event()
        self.calls = []

    def OpenSession(self, request, timeout=None):
        assert self.opened.wait(30)
        response = self.stub.OpenSession(request, timeout=timeout)
        self.calls.append("open")
        return response

    def CloseSession(self, request, timeout=None):
        response = self.stub.CloseSession(request, timeout=timeout)
        self.calls.append("close")
        return response

    def __getattr__(self, name):
        return getattr(self.stub, name)


def test_adaptive_rounds_start_before_the_drafts_prefill_ends():
    """An adaptive generation does not wait for the draft's prefill: its first rounds go without
    speculation, then it speculates, the commits of those rounds delivered to the draft with its
    first Propose. Greedy output unchanged; the draft's session is closed at the end."""
    target_probs = random_markov(12, 33, alpha=0.2)
    draft, target = pair(target_probs, target_probs)
    plain, _ = run(draft, target, SamplingParams(), 60, speculate=False)
    slow = SlowOpen(draft)
    config = LoopConfig(SamplingParams(), 60, lookahead=4, adaptive=True)
    loop = SpeculativeLoop(slow, target, [0, 1, 2], config)
    rounds = loop.rounds()
    early = [next(rounds) for _ in range(3)]
    assert [r.proposed for r in early] == [0, 0, 0]
    slow.opened.set()
    wait_until(lambda: slow.calls, within=10)  # the open done: the next rounds speculate
    later = list(rounds)
    assert loop.generated == plain and sum(r.proposed for r in later) > 0
    assert draft.servicer.engine.open_sessions == 0 == target.servicer.engine.open_sessions
    # A generation that ends before its draft's prefill does: the session is closed when it is.
    short = SlowOpen(draft)
    loop = SpeculativeLoop(short, target, [0, 1, 2], LoopConfig(SamplingParams(), 2, lookahead=4, adaptive=True))
    assert sum(len(r.token_ids) for r in loop.rounds()) == 2
    short.opened.set()
    wait_until(lambda: len(short.calls) == 2, within=10)
    assert short.calls == ["open", "close"]
    assert draft.servicer.engine.open_sessions == 0 == target.servicer.engine.open_sessions


def test_rounds_beside_the_drafts_prefill_take_several_target_steps():
    """Rounds that go without drafts only because the draft's session is still opening ask the
    target for several steps a Score, as speculation off does (a short answer under a grammar ran
    one-token rounds to its end while the draft prefilled, 0.7x speculation off); once the draft is
    open the rounds speculate. Greedy text unchanged."""
    target_probs = random_markov(12, 33, alpha=0.2)
    draft, target = pair(target_probs, target_probs)
    plain, _ = run(draft, target, SamplingParams(), 80, speculate=False)
    slow = SlowOpen(draft)
    loop = SpeculativeLoop(slow, target, [0, 1, 2], LoopConfig(SamplingParams(), 80, lookahead=4))
    rounds = loop.rounds()
    early = [next(rounds) for _ in range(3)]
    assert [r.proposed for r in early] == [0, 0, 0]
    # the first token alone, then PLAIN_STEPS, then as many as the measured overhead asks
    assert [len(r.token_ids) for r in early[:2]] == [1, PLAIN_STEPS] and len(early[2].token_ids) >= PLAIN_STEPS
    slow.opened.set()
    wait_until(lambda: slow.calls, within=10)
    later = list(rounds)
    assert loop.generated == plain and sum(r.proposed for r in later) > 0
    assert draft.servicer.engine.open_sessions == 0 == target.servicer.engine.open_sessions


def hopeless(n: int):
    """A pair whose draft is never the target's argmax, the target's greedy text of n tokens, and
    the pair's costs after an adaptive generation of 300 tokens on it (they say no k pays)."""
    target_probs = random_markov(12, 33, alpha=0.2)
    draft, target = pair(target_probs, np.roll(target_probs, 1, axis=1))
    plain, _ = run(draft, target, SamplingParams(), n, speculate=False)
    costs = PairCosts()
    learn = LoopConfig(SamplingParams(), 300, lookahead=4, adaptive=True)
    list(SpeculativeLoop(draft, target, [0, 1, 2], learn, costs=costs).rounds())
    return draft, target, plain, costs


@pytest.mark.usefixtures("draft_awaited")
def test_adaptive_generation_opens_its_draft_only_when_it_speculates():
    """On a pair where speculation does not pay (every draft rejected), a new adaptive generation
    opens no draft session: under such a load the draft prefilled every prompt for nothing, on
    the core the orchestrator and the clients then had to share. When an exploration wants
    drafts, the session opens holding the tokens committed so far, and output is unchanged."""
    draft, target, plain, costs = hopeless(300)
    config = LoopConfig(SamplingParams(), 300, lookahead=4, adaptive=True)
    assert AdaptiveLookahead(4, costs=costs).would_speculate() is False
    counting = SlowOpen(draft)
    counting.opened.set()
    loop = SpeculativeLoop(counting, target, [0, 1, 2], config, costs=costs)
    rounds = loop.rounds()
    first = next(rounds)
    assert first.proposed == 0 and counting.calls == []  # no draft session
    rest = list(rounds)
    assert loop.generated == plain
    explored = [r for r in rest if r.proposed]
    assert counting.calls[:1] == ["open"] and explored  # an exploration opened it, then drafted
    assert draft.servicer.engine.open_sessions == 0 == target.servicer.engine.open_sessions


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("measured", [False, True], ids=["adaptive", "measured-default"])
def test_under_load_plain_rounds_the_policy_chose_take_several_target_steps(measured):
    """Under load, where the pair's measured costs say no draft pays, an adaptive generation and
    one at the measured default k (the lookahead unset) go without drafts, open no draft session,
    and ask the target for several steps a Score as speculation off does (one-token rounds ran
    0.87x speculation off at 16 clients; the measured default kept speculating at 0.53x). Alone,
    the measured default speculates at its k. Greedy text unchanged."""
    draft, target, plain, costs = hopeless(120)
    config = LoopConfig(SamplingParams(), 120, lookahead=4, adaptive=not measured, measured=measured)
    unary = dataclasses.replace(config, streamed=False)  # an answer read at its end
    RUNNING.add(7)  # seven other generations on the pair
    try:
        counting = SlowOpen(draft)
        counting.opened.set()
        loop = SpeculativeLoop(counting, target, [0, 1, 2], config, costs=costs)
        loaded = list(loop.rounds())
        at_end = SpeculativeLoop(counting, target, [0, 1, 2], unary, costs=costs)
        read_at_end = list(at_end.rounds())
    finally:
        RUNNING.add(-7)
    assert loop.generated == plain == at_end.generated and counting.calls == []  # no draft session opened
    assert [len(r.token_ids) for r in loaded[:2]] == [1, PLAIN_STEPS] and not any(r.proposed for r in loaded)
    # read at its end, as speculation off: MAX_UNARY_STEPS a Score from the first (each return to the
    # orchestrator waits for a step under way: rounds of 1, 4 and 16 steps ran 0.88x speculation off)
    assert [len(r.token_ids) for r in read_at_end] == [MAX_UNARY_STEPS, 120 - MAX_UNARY_STEPS]
    if measured:  # alone it speculates at its k, whatever the price
        alone = SpeculativeLoop(*draft_opens_first(draft, target), [0, 1, 2], config, costs=costs)
        rounds = list(alone.rounds())
        speculating = [r for r in rounds if r.proposed]  # all but its first
        assert alone.generated == plain and len(speculating) > 0.8 * len(rounds)
    assert draft.servicer.engine.open_sessions == 0 == target.servicer.engine.open_sessions


def shared_machine(second_thread: float) -> Sharing:
    """A draft and a target on 2 cores: one thread each at once, or two each in turn, the second
    thread making a forward `second_thread` times faster (the services' profiles)."""
    draft = {
        1: {1: 0.008, 2: 0.020, 4: 0.030},
        2: {n: t / second_thread for n, t in {1: 0.008, 2: 0.020, 4: 0.030}.items()},
    }
    verify = {
        1: {1: 0.040, 5: 0.065, 9: 0.080},
        2: {w: t / second_thread for w, t in {1: 0.040, 5: 0.065, 9: 0.080}.items()},
    }
    return Sharing((1, 2), (1, 2), draft, verify)


def measured(sharing: Sharing, rounds: int = 30) -> PairCosts:
    """The pair's costs after overlapped rounds at k = 4 and 8, each service on its one thread,
    every draft accepted; the steps measured as the profile says."""
    costs = PairCosts(sharing.draft[2], sharing)
    for i in range(rounds):
        k = (4, 8)[i % 2]
        step, verify = sharing.draft[1][1], sharing.verify[1][k + 1]
        draft = DraftCost((k + 1) * step, k + 1, (k + 1) * step, steps=k + 1, step_tokens=k + 1, threads=1)
        costs.update(RoundReport(k, k, draft, verify, k + 1, verify, target_threads=1))
    return costs


def test_the_kind_of_round_is_the_placement_its_price_chooses():
    """On one machine an overlapped round puts both services to work at once on their shares of
    the cores, a sequential one runs them in turn on every core (their works add up). Where a
    second thread barely helps (torch's one-token decode here) overlapped rounds are cheaper;
    where it nearly halves a forward (llama.cpp), rounds in turn on both cores are. A fixed k gets
    that choice too, and its k stays; the verify line is kept at every core's threads, the steps
    measured on one thread brought there by the target's profile."""
    for second_thread, overlapped in ((1.05, True), (1.9, False)):
        costs = measured(shared_machine(second_thread))
        assert costs.verify.fit() == pytest.approx((0.050 / second_thread, 0.00375 / second_thread))  # 2 threads
        assert costs.draft_step(1, threads=2) == pytest.approx(0.008 / second_thread)
        for fixed in (True, False):
            policy = AdaptiveLookahead(4, overlap=True, fixed=fixed, costs=costs)
            k = policy.next_k()
            assert policy.overlapping is overlapped, (second_thread, fixed)
            assert k == 4 or not fixed
        assert costs.threads(True) == (1, 1) and costs.threads(False) == (2, 2)
    alone = PairCosts({1: 0.008})  # two machines (or pinned services): their own threads, whatever the round
    assert alone.threads(True) == alone.threads(False) == (None, None)


def test_rounds_in_turn_add_the_services_work():
    """Sequential rounds on one machine's cores: under load the draft's and the target's work add
    up (they take turns on the same cores), where a pair of devices does each beside the other."""
    line = (0.050, 0.004)
    apart = RoundCosts(0.010, line, load=8, sessions=8)
    together = RoundCosts(0.010, line, load=8, sessions=8, shared=True)
    k = 4
    assert round_time(1.0, k, apart, False) == pytest.approx(max(k * 0.010 + apart.step(40), apart.step(40)))
    assert round_time(1.0, k, together, False) == pytest.approx(k * 0.010 + together.step(40))
    busy = RoundCosts(0.050, line, load=8, sessions=2, shared=True)  # four verify steps of two blocks
    assert round_time(1.0, k, busy, False) == pytest.approx(4 * busy.step(10) + k * 0.050)


def test_under_load_the_targets_step_is_priced_by_its_profile():
    """Under load the verify steps a pair measures are all of about one size (16 generations at
    k = 4 on the shares: 80 tokens on one thread), which leaves the verify line no slope, and a
    plain round's step (16 tokens on every core) was priced from it. Where the cores are shared
    the target's step is its profile at the step's threads, scaled by what its steps measured
    against the profile at theirs (as the draft's): here a plain round of 16 on both cores beats
    every speculating round on the shares (the draft's batched step of 16 is dear), so the policy
    at 16 generations speculates no more; at one generation it still does."""
    verify = {
        1: {1: 0.0404, 5: 0.0652, 9: 0.0776, 17: 0.0994, 33: 0.1447, 65: 0.2297},
        2: {1: 0.0405, 5: 0.0546, 9: 0.0636, 17: 0.0722, 33: 0.0971, 65: 0.1439},
    }
    draft = {1: {1: 0.008, 2: 0.025, 4: 0.034, 8: 0.040, 16: 0.088}}
    draft[2] = {n: t / 1.4 for n, t in draft[1].items()}
    sharing = Sharing((1, 2), (1, 2), draft, verify)
    costs = PairCosts(draft[2], sharing)
    assert costs.target_step(16) is None  # no step measured yet
    n, k = 16, 4
    for _ in range(40):
        step = 1.2 * profiled(verify[1], n * (k + 1))  # serving runs 1.2x its profile
        d = DraftCost((k + 1) * 0.088, k + 1, (k + 1) * 0.088, steps=k + 1, step_tokens=(k + 1) * n, threads=1)
        costs.update(RoundReport(k, k, d, step, n * (k + 1), step, step_sessions=n, target_threads=1), sessions=n)
    assert costs.verify.fit() is None  # one size of step: no slope to price a plain step by
    assert costs.target_step(16) == pytest.approx(1.2 * profiled(verify[2], 16))
    assert costs.target_step(80, threads=1) == pytest.approx(1.2 * profiled(verify[1], 80))
    loaded = AdaptiveLookahead(k, overlap=True, load=lambda: n, costs=costs)
    assert loaded.next_k() == 0
    assert AdaptiveLookahead(k, overlap=True, costs=costs).next_k() > 0  # alone a round is 1 session's
