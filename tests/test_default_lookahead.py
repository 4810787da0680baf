"""The lookahead a request gets when neither it nor the server names one: a greedy or invariant-rule
chain runs at the k its pair's measured costs and acceptance price fastest
(orchestrator.lookahead.measured_lookahead); 4 before the pair has measured anything, and always for
a Leviathan sample (its seed replays whatever ran before it). The choice never changes greedy text."""

from __future__ import annotations

import grpc
import pytest

from draft_service.server import serve as serve_draft
from orchestrator.generation import RequestDefaults
from orchestrator.lookahead import AdaptiveLookahead, measured_lookahead
from orchestrator.pair_costs import ALONE_PLAIN, MEASURED, DraftCost, PairCosts, RoundReport
from orchestrator.server import connect
from orchestrator.server import serve as serve_orchestrator
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.validation import DEFAULT_LOOKAHEAD, MEASURED_LOOKAHEAD
from target_service.server import serve as serve_target


def learned(draft_per_token: float, accepted: float, rounds: int = 40, costs: PairCosts | None = None) -> PairCosts:
    """A pair's costs after rounds at k = 4 and 8 (a verify of 60 ms and 8 ms a token more), the draft
    costing `draft_per_token` a token, `accepted` of each round's drafts accepted (rounded down)."""
    costs = costs if costs is not None else PairCosts()
    policy = AdaptiveLookahead(16, costs=costs)
    for i in range(rounds):
        k = (4, 8)[i % 2]
        policy.update(RoundReport(k, int(k * accepted), draft=draft_per_token * k, target_seconds=0.060 + 0.008 * k))
    return costs


def copied(costs: PairCosts, rounds: int = 200) -> PairCosts:
    """Index rounds on top: chains of 16 accepted whole, no forward (a copy the index drafted)."""
    policy = AdaptiveLookahead(16, costs=costs)
    for _ in range(rounds):
        draft = DraftCost(0.0002, 16)  # the Propose's wire, no step
        policy.update(RoundReport(16, 16, draft=draft, target_seconds=0.060 + 0.008 * 16, indexed=True))
    return costs


def test_the_measured_k_is_the_price_of_the_pairs_costs():
    assert measured_lookahead(PairCosts(), MEASURED_LOOKAHEAD, overlap=True) is None  # nothing measured yet
    cheap = learned(0.002, 1.0)  # a cheap draft that is always right: the most drafts a round
    assert measured_lookahead(cheap, MEASURED_LOOKAHEAD, overlap=False) == MEASURED_LOOKAHEAD
    assert measured_lookahead(cheap, 8, overlap=False) == 8
    dear = learned(0.030, 0.5)  # a draft half the target's step, right half the time: few drafts
    k = measured_lookahead(dear, MEASURED_LOOKAHEAD, overlap=False)
    assert 1 <= k < 4
    # the same price the adaptive policy gives a generation alone on the pair
    alone = AdaptiveLookahead(MEASURED_LOOKAHEAD, costs=dear)
    assert alone.next_k() == k
    hopeless = learned(0.060, 0.0)  # no draft pays: the smallest k, never none (it was asked to speculate)
    assert measured_lookahead(hopeless, MEASURED_LOOKAHEAD, overlap=False) == 1


def test_a_hybrids_index_rounds_do_not_price_its_model():
    """The hybrid's index rounds (free drafts, a copy's acceptance) leave its model's price as its
    model rounds set it; a drafter that is an index alone is priced by them."""
    model = measured_lookahead(learned(0.030, 0.5), MEASURED_LOOKAHEAD, overlap=False)
    assert 1 <= model < 4
    hybrid = copied(learned(0.030, 0.5, costs=PairCosts(index_apart=True)))
    assert measured_lookahead(hybrid, MEASURED_LOOKAHEAD, overlap=False) == model
    assert hybrid.verify.w > learned(0.030, 0.5).verify.w  # the target's verifies count all the same
    index_alone = copied(learned(0.030, 0.5))
    assert measured_lookahead(index_alone, MEASURED_LOOKAHEAD, overlap=False) == MEASURED_LOOKAHEAD


def test_alone_plain_rounds_only_where_speculation_timed_clearly_slower():
    """A start-up timing within its noise of plain rounds leaves a request alone speculating; one
    clearly slower (below ALONE_PLAIN), or a price below 1, runs it plain rounds."""
    costs = PairCosts()
    assert not costs.alone_plain()  # not timed
    for gain, timed, plain in ((0.95, True, False), (1.05, True, False), (0.85, True, True), (0.95, False, True)):
        costs.alone_gain, costs.alone_timed = gain, timed
        assert costs.alone_plain() == plain, (gain, timed)
    assert ALONE_PLAIN < 1


@pytest.fixture
def orchestrator(tiny_backends):
    draft_server, draft_port = serve_draft(tiny_backends["draft"])
    target_server, target_port = serve_target(tiny_backends["target"])
    pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
    server, port = serve_orchestrator(pair, defaults=RequestDefaults(overlap=False))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pair, orchestrator_pb2_grpc.OrchestratorStub(channel)
    finally:
        channel.close()
        for s in (server, draft_server, target_server):
            s.stop(None)


def generate(stub, sampling=None, seed=None, **speculation) -> orchestrator_pb2.GenerateResponse:
    request = orchestrator_pb2.GenerateRequest(
        prompt="the measured default",
        max_new_tokens=40,
        sampling=sampling or model_pb2.SamplingParams(),
        speculation=orchestrator_pb2.SpeculationParams(**speculation),
        seed=seed,
    )
    return stub.Generate(request, timeout=120)


@pytest.mark.usefixtures("draft_awaited")
def test_an_unset_lookahead_runs_at_the_measured_k(orchestrator):
    pair, stub = orchestrator
    reference = generate(stub, lookahead=4)  # the pair measures its rounds (and a request's own k stands)
    assert reference.stats.lookahead == 4
    chosen = []
    for _ in range(3):
        expected = measured_lookahead(pair.costs, MEASURED_LOOKAHEAD, overlap=False)
        reply = generate(stub)
        assert reply.stats.lookahead == (expected or DEFAULT_LOOKAHEAD)
        assert reply.token_ids == reference.token_ids  # greedy: the target's text whatever k
        chosen.append(expected)
    assert chosen[-1] is not None  # measured by then
    assert generate(stub, disabled=True).stats.lookahead == 0


@pytest.mark.usefixtures("draft_awaited")
def test_a_leviathan_sample_keeps_the_fixed_default_and_its_seed_replays(orchestrator):
    pair, stub = orchestrator
    sampled = model_pb2.SamplingParams(temperature=0.8)
    first = generate(stub, sampled, seed=7)
    for _ in range(2):
        generate(stub)  # greedy requests: the pair measures its costs
    assert measured_lookahead(pair.costs, MEASURED_LOOKAHEAD, overlap=False) is not None
    again = generate(stub, sampled, seed=7)
    assert first.stats.lookahead == again.stats.lookahead == DEFAULT_LOOKAHEAD
    assert again.token_ids == first.token_ids
    # the invariant rule: the target's own sample whatever k, so it gets the measured k
    invariant = dict(rule=orchestrator_pb2.RULE_INVARIANT)
    at_four = generate(stub, sampled, seed=7, lookahead=4, **invariant)
    expected = measured_lookahead(pair.costs, MEASURED_LOOKAHEAD, overlap=False)
    measured = generate(stub, sampled, seed=7, **invariant)
    assert measured.stats.lookahead == expected
    assert measured.token_ids == at_four.token_ids


def test_under_load_the_measured_default_speculates_only_where_its_regime_measures_faster():
    """The measured default's k stands alone; under load the pair's regimes decide between it and
    plain rounds, as for adaptive lookahead (what each commits a second, measured in turn). A
    request's own fixed k keeps it and is no regime's: its commits are not counted as one."""
    costs = PairCosts()
    load = [8]
    measured = AdaptiveLookahead(8, overlap=True, fixed=True, measured=True, load=lambda: load[0], costs=costs)
    fixed = AdaptiveLookahead(8, overlap=True, fixed=True, load=lambda: load[0], costs=costs)
    for i in range(60):  # a cheap draft, mostly right: the price promises speculation at 8 clients
        k = (2, 4)[i % 2]
        draft = DraftCost(0.032 * k, k, 0.032 * k, steps=k, step_tokens=8 * k)
        target = 0.1 + 0.004 * (8 * (k + 1) - 1)
        measured.update(RoundReport(k, k - (i % 4 < 2), draft, target, 8 * (k + 1), target, step_sessions=8))
    clock, spent = 100.0, {True: 0.0, False: 0.0}
    fixed.update(RoundReport(8, 8, DraftCost(0.3, 8), 0.2, 72, 0.2, 8, committed=9, at=clock))
    assert costs.rates == {}  # a fixed k's rounds measure no regime
    while clock < 100 + 4 * MEASURED:  # 8 generations: speculating 10 tokens a second each, plain 12.5
        k = measured.next_k()
        assert k in (0, 8)
        took = (k / 10.0 if k else 1 / 12.5) / 8
        clock += took
        spent[k > 0] += took
        if k:
            draft = DraftCost(0.032 * k, k, 0.032 * k, steps=k, step_tokens=8 * k)
            target = 0.1 + 0.004 * (8 * (k + 1) - 1)
            measured.update(RoundReport(k, k, draft, target, 8 * (k + 1), target, 8, committed=k, at=clock))
        else:
            measured.update(RoundReport(0, 0, 0.0, 0.13, 8, 0.13, committed=1, at=clock))
    assert spent[True] >= MEASURED and spent[False] >= MEASURED  # each regime measured
    assert measured.next_k() == 0 and measured.may_stop  # plain rounds commit more: taken
    assert fixed.next_k() == 8 and not fixed.may_stop  # a request's own k stands
    load[0] = 1
    assert measured.next_k() == 8  # alone: its k
