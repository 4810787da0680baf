"""Adaptive lookahead: the k and the kind of round it chooses from the pair's measured costs and
acceptance (orchestrator.lookahead, orchestrator.pair_costs), alone and under load, and that its
choices never change the output."""

from __future__ import annotations

import dataclasses

import pytest

from draft_service.drafters import MODEL
from orchestrator.lookahead import (
    MARGIN,
    UNPROVEN,
    AdaptiveLookahead,
    RoundCosts,
    best_lookahead,
    round_time,
    speculates,
    speedup,
)
from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.pair_costs import (
    MEASURED,
    MISPRICED,
    REVISIT,
    DraftCost,
    PairCosts,
    RoundReport,
    load_class,
    profiled,
)
from specdec.decoding.sampling import SamplingParams
from tests.harness import wait_until
from tests.standins import draft_opens_first, markov_pair, random_markov


def as_priced(costs: PairCosts, load: int) -> None:
    """Both kinds of round took their price at `load` for two steps: the formula decides there
    (see lookahead's Calibration)."""
    for _ in range(2 * load):
        costs.calibrate(load, True, 1.0)
        costs.calibrate(load, False, 1.0)


def alone(cost_ratio: float, step: float = 0.1, slope: float = 0.0) -> RoundCosts:
    """One generation, a draft step `cost_ratio` target steps, a target step of `step` seconds
    (+ `slope` a token fed)."""
    return RoundCosts(draft=cost_ratio * step, verify=(step, slope))


def test_best_lookahead_follows_the_formula():
    """Alone, sequential rounds and a target step that costs the same whatever k (a GPU's): the
    speedup is Leviathan et al.'s (1 - a^(k+1)) / ((1 - a)(k c + 1)), c = draft / target step."""

    def best(alpha, c, k_max=8):
        return best_lookahead(alpha, alone(c), 0.1, k_max, overlap=False)[0]

    assert best(0.0, 0.5) == 0  # nothing is ever accepted: no speculation
    assert best(1.0, 1.2) == 0  # a round costs more than the tokens it wins
    assert best(0.99, 0.01) == 8  # cheap, accurate draft: longest k
    for alpha, c in [(0.6, 0.3), (0.8, 0.5), (0.9, 0.1)]:
        k = best(alpha, c, 16)
        assert all(
            speedup(alpha, k, alone(c), False, 0.1) >= speedup(alpha, j, alone(c), False, 0.1) for j in range(17)
        )
    assert speedup(0.8, 4, alone(0.5), False, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 3))


def test_adaptive_lookahead_moves_with_acceptance():
    policy = AdaptiveLookahead(k_max=8)
    assert policy.next_k() == 8  # no evidence yet
    for _ in range(20):  # every draft rejected, expensive draft
        k = policy.next_k()
        policy.update(RoundReport(proposed=k, accepted=0, draft=0.4 * k / 8, target_seconds=0.1))
    assert policy.next_k() == 0  # no speculation
    for _ in range(60):  # every draft accepted, cheap draft: found by the exploring rounds
        k = policy.next_k()
        policy.update(RoundReport(proposed=k, accepted=k, draft=0.001 * k, target_seconds=0.1))
    assert policy.next_k() == 8


def test_explorations_back_off_while_speculation_does_not_pay():
    """Under a steady load where no k pays, each exploring round that finds so doubles the wait
    before the next (8, 16, 32, ...): over 500 rounds a handful, not one in every nine rounds;
    when one finds speculation paying again, the wait resets."""
    policy = AdaptiveLookahead(k_max=8)
    explored = []
    for i in range(500):
        k = policy.next_k()
        if k and i > 5:
            explored.append(i)
        policy.update(RoundReport(proposed=k, accepted=0, draft=0.05 * k, target_seconds=0.1))
    gaps = [b - a for a, b in zip(explored, explored[1:], strict=False)]
    assert 3 <= len(explored) <= 7 and gaps == sorted(gaps), explored
    assert gaps[-1] > 100  # capped at EXPLORE_MAX rounds off
    for _ in range(200):  # the draft starts paying: found by the next exploration, and kept
        k = policy.next_k()
        policy.update(RoundReport(proposed=k, accepted=k, draft=0.001 * k, target_seconds=0.1))
    assert policy.next_k() > 0 and policy.costs.explore_after == 8


def test_an_exploration_without_the_drafts_session_is_made_at_the_next_round():
    """An exploring round whose draft session was still opening ran without drafts: the next round
    explores instead, at the same wait, and once it drafts and finds speculation paying the policy
    speculates (before, the wait doubled on no evidence and a new generation never explored)."""
    policy = AdaptiveLookahead(k_max=8)
    for _ in range(20):  # every draft rejected, expensive draft: speculation off
        k = policy.next_k()
        policy.update(RoundReport(proposed=k, accepted=0, draft=0.4 * k / 8, target_seconds=0.1))
    while not policy.next_k():  # k = 0 rounds until the exploration
        policy.update(RoundReport(proposed=0, accepted=0, draft=0.0, target_seconds=0.1))
    wait = policy.costs.explore_after
    policy.unexplored()  # that round had no draft session yet
    policy.update(RoundReport(proposed=0, accepted=0, draft=0.0, target_seconds=0.1))
    k = policy.next_k()
    assert k > 0 and policy.exploring and policy.costs.explore_after == wait
    for _ in range(40):  # the draft, open now, pays: explorations find it
        policy.update(RoundReport(proposed=k, accepted=k, draft=0.001 * k, target_seconds=0.1))
        k = policy.next_k() or policy.next_k()
    assert policy.next_k() > 0
    policy.exploring = False
    policy.unexplored()  # not exploring: nothing changes
    assert policy.costs.explore_after == 8


def test_generations_on_a_pair_start_from_its_costs():
    """What one generation measured of its pair (here: speculation does not pay) the next one
    starts from, instead of from k_max with no evidence; its acceptance is its own, with the
    pair's as a prior; the pair's explorations back off for all its generations together."""
    costs = PairCosts()
    first = AdaptiveLookahead(k_max=8, costs=costs)
    for _ in range(20):  # every draft rejected, expensive draft
        k = first.next_k()
        first.update(RoundReport(proposed=k, accepted=0, draft=0.4 * k / 8, target_seconds=0.1))
    assert first.next_k() == 0
    assert AdaptiveLookahead(k_max=8).next_k() == 8  # alone: no evidence yet
    second = AdaptiveLookahead(k_max=8, costs=costs)
    assert second.alpha() == pytest.approx(costs.accepted / (costs.accepted + costs.rejections))
    assert second.next_k() == 0  # the pair's evidence
    off = costs.off_rounds
    assert first.next_k() == 0 and costs.off_rounds == off + 1  # one count of rounds off for both
    third = AdaptiveLookahead(k_max=8, costs=costs)
    for _ in range(5):  # the second's text is one its draft predicts, the third's one it does not
        second.update(RoundReport(proposed=2, accepted=2, draft=0.002, target_seconds=0.1))
        third.update(RoundReport(proposed=2, accepted=0, draft=0.002, target_seconds=0.1))
    assert second.alpha() > 0.8 > 0.3 > third.alpha()


def test_the_start_pools_its_prompts_acceptance_not_the_last_ones_tail():
    """The pair's acceptance weighs its last few rounds (DECAY); the start-up calibration pools every
    round since its start, each alike, at the same weight: a last prompt whose tail the draft copies
    whole (code) does not price the first request as if every text did."""
    costs = PairCosts()
    policy = AdaptiveLookahead(k_max=8, costs=costs)
    since = costs.tally
    for _ in range(20):  # a question: half the rounds rejected at the second draft
        policy.update(RoundReport(proposed=4, accepted=1, draft=0.01, target_seconds=0.1))
        policy.update(RoundReport(proposed=4, accepted=4, draft=0.01, target_seconds=0.1))
    for _ in range(20):  # code: every draft accepted
        policy.update(RoundReport(proposed=4, accepted=4, draft=0.01, target_seconds=0.1))
    weight = costs.accepted + costs.rejections
    assert costs.accepted / weight > 0.99  # the tail's
    costs.pool_acceptance(since)
    assert costs.accepted + costs.rejections == pytest.approx(weight)
    assert costs.accepted / weight == pytest.approx(180 / 200)  # 180 accepted, 20 rejections
    before = costs.accepted
    costs.pool_acceptance(costs.tally)  # no round since: nothing to pool
    assert costs.accepted == before


def test_loops_given_one_pairs_costs_share_them():
    target_probs = random_markov(12, 31)
    draft, target = markov_pair(target_probs, random_markov(12, 32), MODEL)
    costs = PairCosts()
    config = LoopConfig(SamplingParams(), 40, lookahead=4, adaptive=True, seed=3)
    # the first waits for its draft's open (its rounds do not, and a loaded machine ran them all
    # before it: nothing priced); the second's policy, on the costs the first measured, may not open it
    loops = [
        SpeculativeLoop(*stubs, [0, 1, 2], config, costs=costs)
        for stubs in (draft_opens_first(draft, target), (draft, target))
    ]
    list(loops[0].rounds())
    measured = costs.verify.w
    assert measured > 0 and loops[1].policy.costs is costs
    list(loops[1].rounds())
    assert costs.verify.w > measured
    # every quiet round after a generation's first measured its time against its price (alone: load 1)
    assert costs.priced[0][False].weight + costs.priced[0][True].weight > 0 and set(costs.priced) == {0}


def test_rounds_behind_a_prefill_are_not_calibrated():
    """A round during which a prompt was prefilled on the pair (an OpenSession in flight, this
    generation's or another's) waited behind it: its time says nothing of the rounds to come
    and is not compared with its price; its own opens count as prefills too."""
    target_probs = random_markov(12, 31)
    draft, target = markov_pair(target_probs, random_markov(12, 32), MODEL)
    costs = PairCosts()
    config = LoopConfig(SamplingParams(), 40, lookahead=4, adaptive=True, seed=3)
    costs.prefill(started=True)  # another generation's prompt, prefilling all along
    loop = SpeculativeLoop(*draft_opens_first(draft, target), [0, 1, 2], config, costs=costs)
    list(loop.rounds())
    assert loop.stats.rounds > 2 and costs.verify.w > 0 and costs.priced == {}
    assert wait_until(lambda: costs.prefilling == 1, 10)  # the draft's open (on the continuation pool) has left
    costs.prefill(started=False)
    mark = costs.quiet_since()
    assert costs.quiet(mark) and costs.prefilling == 0
    costs.prefill(started=True)
    costs.prefill(started=False)
    assert not costs.quiet(mark) and costs.quiet(costs.quiet_since())  # one ran in between


def loaded(load: int, draft_ms: float, costs: PairCosts) -> AdaptiveLookahead:
    """A policy at `load` after 60 rounds of k = 2 and 4 (no rates: committed not given): a draft
    that batches nothing (`draft_ms` a session in its step), a target of 4 ms a token."""
    policy = AdaptiveLookahead(k_max=8, overlap=True, load=lambda: load, costs=costs)
    for i in range(60):
        k = (2, 4)[i % 2]
        step = draft_ms / 1000 * load
        draft = DraftCost(step * k, k, step * k, steps=k, step_tokens=load * k)
        target = 0.100 + 0.004 * (load * (k + 1) - 1)
        policy.update(RoundReport(k, k - (i % 4 < 2), draft, target, load * (k + 1), target, step_sessions=load))
    return policy


def test_on_devices_of_their_own_rounds_stop_overlapping_under_load():
    """Services on devices of their own (PairCosts.overlap_load, set by the server where they share
    neither cores nor an accelerator): past overlap_load generations the policy's rounds are sequential, priced so, as a
    fixed k's are (the others' rounds keep each device busy; a continuation is a call and drafts a
    rejection throws away), and taken above 1 + MARGIN where unmeasured (the measured regimes veto
    them); up to it, and on shared cores at every load, the price chooses, an unmeasured load's
    speculation above 1 + UNPROVEN."""
    for load, k, overlapped in ((4, 4, True), (8, 3, True)):  # on shared cores: overlapped rounds
        policy = loaded(load, 4.0, PairCosts())
        assert (policy._best_k(), policy.overlapping) == (k, overlapped)
    alone = loaded(4, 4.0, PairCosts(overlap_load=4))
    assert (alone._best_k(), alone.overlapping) == (4, True)
    apart = loaded(8, 4.0, PairCosts(overlap_load=4))
    assert apart._best_k() > 0 and not apart.overlapping  # sequential rounds that promise ~1.3x
    assert 1 + MARGIN < apart.promised < 1 + UNPROVEN
    shared = loaded(8, 4.0, PairCosts())  # the same sequential price where the error is not known
    shared.overlap = False
    assert shared._best_k() == 0 and shared.promised == pytest.approx(apart.promised)
    slow = loaded(8, 12.0, PairCosts(overlap_load=4))  # a draft whose rounds promise under 1 + MARGIN
    assert slow._best_k() == 0 and not slow.overlapping and slow.promised < 1 + MARGIN
    fixed = AdaptiveLookahead(k_max=4, overlap=True, fixed=True, load=lambda: 8, costs=apart.costs)
    assert fixed._best_k() == 4 and not fixed.overlapping


def test_under_load_the_regime_that_commits_more_a_second_is_taken():
    """Under load the pair measures what its rounds commit a second in each regime (speculating
    or not) at each load class: the price's choice runs MEASURED seconds, then the other does,
    then the faster is taken and the slower revisited MEASURED seconds in every REVISIT; a
    regime's first step after a switch is not counted. A price that promises speculation where
    it runs slower (as at 8 clients on 2 shared cores) stops deciding."""
    costs = PairCosts()
    eight = loaded(8, 4.0, costs)
    assert eight._best_k() > 0 and eight.promised > 1 + UNPROVEN and costs.rates == {}
    clock = [100.0]

    def rounds(seconds: float, speculating: float, plain: float) -> dict[bool, float]:
        """Rounds of 8 generations for `seconds` (one policy stands for them), each generation
        committing `speculating` tokens a second while it speculates, `plain` while it does not;
        the seconds spent in each regime."""
        spent = {True: 0.0, False: 0.0}
        end = clock[0] + seconds
        while clock[0] < end:
            k = eight.next_k()
            took = (k / speculating if k else 1 / plain) / 8  # the pair commits 8 times as often as a generation
            clock[0] += took
            spent[k > 0] += took
            if k:
                draft = DraftCost(0.032 * k, k, 0.032 * k, steps=k, step_tokens=8 * k)
                target = 0.1 + 0.004 * (8 * (k + 1) - 1)
                eight.update(RoundReport(k, k, draft, target, 8 * (k + 1), target, 8, committed=k, at=clock[0]))
            else:
                eight.update(RoundReport(0, 0, 0.0, 0.13, 8, 0.13, committed=1, at=clock[0]))
        return spent

    # the price's choice first, speculation: a step to settle, then MEASURED seconds; then plain
    # rounds the same
    first = rounds(MEASURED, speculating=10.0, plain=12.5)
    assert first[False] == 0 and costs.rates[load_class(8)][True][2] < MEASURED
    rounds(MEASURED + 1.0, speculating=10.0, plain=12.5)
    assert costs.rates[load_class(8)][True][2] == pytest.approx(MEASURED, abs=0.15)
    assert costs.rates[load_class(8)][False][2] > MEASURED  # then the faster: plain rounds
    rate = {kind: kept[0] / kept[1] for kind, kept in costs.rates[load_class(8)].items()}
    assert rate == {True: pytest.approx(10.0), False: pytest.approx(12.5)}
    # the price still promises speculation, but plain rounds are faster: taken, speculation
    # revisited for MEASURED seconds (and a step to settle) after REVISIT, then after twice as
    # long (slower still); no lone explorations
    assert eight.promised > 1 + UNPROVEN and eight._best_k() == 0
    later = rounds(4 * REVISIT, speculating=10.0, plain=12.5)
    assert 2 * MEASURED < later[True] < 2 * MEASURED + 2 and costs.faster[load_class(8)].wait == 4 * REVISIT
    # the text moves: speculation now commits more a second, and is taken from its next revisit
    rounds(4 * REVISIT, speculating=40.0, plain=12.5)
    assert costs.faster[load_class(8)].faster and costs.faster[load_class(8)].wait == REVISIT
    latest = rounds(REVISIT, speculating=40.0, plain=12.5)
    assert 1 - 2 * MEASURED / REVISIT < latest[True] / REVISIT < 1
    # other loads are measured apart: there the price decides until a regime is measured
    assert load_class(16) not in costs.rates
    assert costs.measured_choice(16, priced=False) is False and costs.measured_choice(16, priced=True) is True


@pytest.mark.parametrize("answer", [0.6, 2.4], ids=["10ms-steps", "38ms-steps"])
def test_the_dips_of_requests_ending_together_do_not_restart_a_regimes_measurement(answer):
    """Closed-loop clients end their requests together: the load falls to 1 and climbs back within
    a round, and unary plain rounds commit a whole answer each (MAX_UNARY_STEPS a Score), so the
    pair commits in bursts an answer apart. Those dips are no change of load, and the gap between
    the bursts no pause, however long an answer takes: plain rounds measure the time between the
    bursts at the busiest recent load, and take MEASURED seconds to measure. Before, each dip
    restarted the regime at 2-4 and the first commit after it fell in a switch's unsettled step
    (adaptive at 8 stand-in clients: plain rounds measured 4 s in 16, and ran there), and answers
    over IDLE were never measured (plain rounds ran for good)."""
    costs = PairCosts()
    load = [8]
    eight = loaded(8, 4.0, costs)
    eight.load = lambda: load[0]
    clock = [100.0]
    step = answer / 64  # the target's step of 8 sessions
    rates = {}  # each regime's rate as last measured (a switch restarts the one it switches to)

    def answers(seconds: float) -> list[bool]:
        """Answers of 64 tokens by each of 8 clients in lockstep, for `seconds`: the generations
        start one by one (each chooses its first round as the load climbs), run the regime chosen
        at 8, and end one by one (each reporting its last round as the load falls); whether each
        answer speculated."""
        ran, end = [], clock[0] + seconds
        while clock[0] < end:
            for arrived in range(1, 9):
                load[0] = arrived
                eight.next_k()
            k = eight.next_k()
            ran.append(k > 0)
            rounds, tokens = (16, 4) if k else (1, 64)  # a speculating round: 4 tokens in 3 steps' time
            for r in range(rounds):
                clock[0] += 3 * step if k else answer  # a unary answer's plain rounds: one Score of 64 steps
                for g in range(8):
                    load[0] = 8 - g if r == rounds - 1 else 8  # the last round: the load falls as each ends
                    clock[0] += 0.0002
                    # the costs `loaded` priced (the formula speculates), not quiet (beside the arrivals'
                    # prefills: the price is not calibrated); the rounds' own times as the clock runs
                    if k:
                        draft = DraftCost(0.128, 4, 0.128, steps=4, step_tokens=32)
                        report = RoundReport(4, 4, draft, 0.256, 40, 0.256, 8, 3 * step, committed=tokens)
                    else:  # its 64 steps reported as one-token rounds' (plain_rounds: _measure_steps)
                        report = RoundReport(0, 0, 0.0, 0.13, 8, 0.13, 8, step, committed=tokens, steps=64)
                    eight.update(dataclasses.replace(report, quiet=False, at=clock[0]))
            kinds = costs.rates.get(load_class(8), {})
            rates.update({kind: kept[0] / kept[1] for kind, kept in kinds.items() if kept[1]})
        return ran

    # speculation first (the price's choice), MEASURED seconds of it; then plain rounds, which
    # measure theirs within an answer or two more than MEASURED seconds hold
    assert eight.next_k() > 0
    answers(MEASURED + 1)
    assert costs.rates[load_class(8)][True][2] >= MEASURED
    ran = answers(MEASURED + 2 * answer)
    assert not ran[0] and costs.rates[load_class(8)][False][2] >= MEASURED - answer, costs.rates
    # each measured at its rate, 4 tokens in 3 steps' time against one a step (within 15%: the last
    # to end commits alone, counted for no regime): speculation taken
    assert rates[True] == pytest.approx(4 / 3 / step, rel=0.15) and rates[False] == pytest.approx(1 / step, rel=0.15)
    assert all(answers(4 * answer)[1:]), (rates, costs.faster)


def test_a_fixed_k_under_load_calibrates_the_price_at_its_load():
    """A request that names k speculates under load whatever the price says; its quiet rounds are
    compared with their price as the policy's are, so that adaptive lookahead at that load starts
    from what they measured, not from the formula's promise (after k = 4 at 8 clients, the formula
    uncalibrated promised 1.69x, and adaptive lookahead spent 8 s of a 60 s cell measuring
    speculation at 0.4x). Alone a fixed k is not priced (the price is the formula's there)."""
    costs = PairCosts()
    eight = loaded(8, 4.0, costs)
    assert costs.calibration(8) is None and eight._best_k() > 0 and eight.promised > 1 + UNPROVEN
    alone = AdaptiveLookahead(k_max=4, fixed=True, costs=costs)
    assert alone._best_k() == 4 and alone.priced is None
    fixed = AdaptiveLookahead(k_max=4, overlap=True, fixed=True, load=lambda: 8, costs=costs)
    for _ in range(16):  # two steps of 8 generations' rounds, each 2.5 times its price
        assert fixed._best_k() == 4
        draft = DraftCost(0.2, 4, 0.2, 4, 32)
        fixed.update(RoundReport(4, 2, draft, 0.15, 40, 0.15, 8, round_seconds=2.5 * fixed.priced[0]))
    assert costs.calibration(8) == pytest.approx(0.4, rel=0.01)
    assert eight.promised * 0.4 < 1 and eight._best_k() == 0 and costs.rates == {}  # nothing to measure


def test_under_load_speculation_is_priced_by_what_its_rounds_measured_at_that_load():
    """The price misses more of a speculating round's time at some loads than at others
    (measured over quiet rounds: 0.9-1.4 of it at 8 clients, 1.5-2.2 at 16). The pair keeps each
    kind of round's measured/priced ratio per load class; under load the gain is corrected by
    the plain rounds' ratio over the speculating rounds'. Where speculation is not measured,
    the formula must promise 1 + UNPROVEN: at 16 it is not taken on a promise of 1.2x."""
    assert [load_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    costs = PairCosts()
    eight = loaded(8, 4.0, costs)
    assert costs.calibration(8) is None and eight._best_k() > 0 and eight.promised > 1 + UNPROVEN
    # quiet rounds at load 8 as the policy priced them: speculating ones took twice their price,
    # plain ones half of theirs
    spec_price, plain_price, load = eight.priced
    assert load == 8 and 0 < plain_price < spec_price
    for _ in range(16):  # two steps: a round of each of 8 generations is one
        eight.update(RoundReport(1, 1, DraftCost(0.2, 2, 0.2, 2, 16), 0.15, 16, 0.15, 8, round_seconds=2 * spec_price))
        eight.priced = (spec_price, plain_price, 8)
    assert costs.calibration(8) == pytest.approx(0.5, rel=0.01)  # plain rounds not measured there: 1
    for _ in range(16):
        eight.update(RoundReport(0, 0, 0.0, 0.15, 8, 0.15, round_seconds=plain_price / 2))
        eight.priced = (spec_price, plain_price, 8)
    assert costs.calibration(8) == pytest.approx(0.25, rel=0.01)
    assert eight.promised * 0.25 < 1 - MARGIN and eight._best_k() == 0
    # 16, not measured: the formula's 1.1-1.5x is not taken; measured cheaper than priced, it is
    sixteen = loaded(16, 6.0, PairCosts())
    assert sixteen._best_k() == 0 and 1 + MARGIN < sixteen.promised < 1 + UNPROVEN
    sixteen.costs.calibrate(16, True, 0.5)  # one round of 16: not a step yet
    assert sixteen.costs.calibration(16) is None
    for _ in range(16):
        sixteen.costs.calibrate(16, True, 0.5)
    assert sixteen._best_k() > 0
    # a transient counts as MISPRICED times its price
    for _ in range(64):
        costs.calibrate(32, True, 50.0)
        costs.calibrate(32, False, 1.0)
    assert costs.calibration(32) == pytest.approx(1 / MISPRICED)
    # explorations ride in everyone's steps, rounds behind a prefill are not quiet, drafts the
    # policy did not choose (an exploration's continuation, carried) were not priced: none counts
    before = [(v.total, v.weight) for v in costs.priced[load_class(8)].values()]
    assert eight._best_k() == 0 and eight.priced[0] is None
    eight.update(RoundReport(2, 2, DraftCost(0.2, 2, 0.2, 2, 16), 0.15, 24, 0.15, 8, round_seconds=10.0))
    eight.priced = (spec_price, plain_price, 8)
    eight.exploring = True
    eight.update(RoundReport(2, 2, DraftCost(0.2, 2, 0.2, 2, 16), 0.15, 24, 0.15, 8, round_seconds=10.0))
    eight.exploring = False
    eight.update(RoundReport(2, 2, DraftCost(0.2, 2, 0.2, 2, 16), 0.15, 24, 0.15, 8, round_seconds=10.0, quiet=False))
    assert [(v.total, v.weight) for v in costs.priced[load_class(8)].values()] == before


def test_adaptive_lookahead_prices_the_verify_cost():
    """A target whose round time grows with the tokens it scores makes long rounds dear. With
    T(k) = 0.1 + 0.07 k seconds and a draft at 0.05 s a token, c = 0.5 and s = 0.7: at full
    acceptance no k pays (c + s > 1: S(1) = 2 / 2.2), found after one exploring round, so no
    speculation (k = 0); against a flat T = 0.1 the same draft takes k_max."""

    def run(slope: float) -> AdaptiveLookahead:
        policy = AdaptiveLookahead(k_max=8)
        for _ in range(30):
            k = policy.next_k()
            policy.update(RoundReport(proposed=k, accepted=k, draft=0.05 * k, target_seconds=0.1 + slope * k))
        return policy

    flat, steep = run(0.0), run(0.07)
    assert flat.next_k() == 8
    assert steep.next_k() == 0 == best_lookahead(1.0, alone(0.5, slope=0.07), 0.1, 8, overlap=False)[0]
    assert steep.costs.verify_cost(8) == pytest.approx((0.1, 0.07))


def test_adaptive_lookahead_speculates_less_under_load():
    """The target reports the tokens of the batched step that scored each round; the policy
    fits the step's cost over them (here 0.05 s + 7.5 ms a token, measured at loads 1..3) and
    prices speculation for N generations against N one-token rounds: with the same
    measurements k falls as N grows from 2 (alone the rounds wait for the draft; from 2 on
    their drafting hides under the others' verifies), to break-even at 16 (k <= 1; acceptance
    ~0.8, a draft at 20 ms a token)."""
    load = [1]
    policy = AdaptiveLookahead(k_max=8, load=lambda: load[0])
    for i in range(40):
        k, sessions = (2, 4, 6, 8)[i % 4], 1 + i % 3
        step = sessions * (k + 1)
        policy.update(RoundReport(k, 3 * k // 4, 0.02 * k, 0.05 + 0.0075 * step, step_tokens=step))
    assert policy.costs.verify_cost(8) == pytest.approx((0.0575, 0.0075))
    ks = []
    for n in (1, 2, 4, 8, 16):
        load[0] = n
        ks.append(policy._best_k())
    assert ks[0] >= 2 and ks[1:] == sorted(ks[1:], reverse=True) and ks[-1] <= 1, ks


@pytest.mark.parametrize("queued", [0.0, 0.1])
def test_adaptive_lookahead_prices_what_speculating_rounds_wait(queued):
    """The line is fitted over the step's compute as the target reports it (here 50 ms + 2 ms a
    token), and what a round waits beyond it is measured apart for rounds that speculated and
    rounds that did not. 8 generations, a cheap draft (5 ms a token), acceptance 2/3: when
    speculating rounds wait as long as the others, k = 2..3 pays; when they queue 100 ms more
    (sessions back from the draft at different times wait for the step in progress), none does."""
    policy = AdaptiveLookahead(k_max=8, load=lambda: 8)
    for i in range(60):
        k = (0, 2, 4)[i % 3]
        step = 8 * (k + 1)
        compute = 0.05 + 0.002 * (step - 1)
        waited = compute + 0.002 + (queued if k else 0.0)
        policy.update(RoundReport(k, 3 * k // 4, 0.005 * k, waited, step_tokens=step, target_compute=compute))
    assert policy.costs.verify_cost(8) == pytest.approx((0.05, 0.002))
    assert policy.costs.wait(True) == pytest.approx(0.002 + queued)
    assert policy.costs.wait(False) == pytest.approx(0.002)
    as_priced(policy.costs, 8)
    if queued:
        assert policy._best_k() == 0
    else:
        assert 2 <= policy._best_k() <= 3


def test_a_plain_rounds_wait_is_its_own_not_the_speculating_rounds_queue():
    """Under load speculating rounds queue behind the steps of generations out of step with them
    (80 ms here), where rounds without speculation share one step and wait for little (3 ms). Once
    every round speculates, a plain round's wait is still its own as last measured: priced with
    the speculating rounds' queueing, a plain step of 16 on 2 shared cores looked 1.6x its cost
    and adaptive lookahead speculated at 0.65x speculation off. Speculating rounds not measured
    lately are priced by the others' wait, as before."""
    policy = AdaptiveLookahead(k_max=4, load=lambda: 8)
    for _ in range(16):
        policy.update(RoundReport(0, 0, 0.0, 0.05 + 0.003, step_tokens=8, target_compute=0.05))
    for _ in range(200):  # 25 steps of all 8 generations
        policy.update(RoundReport(4, 4, 0.02, 0.10 + 0.08, step_tokens=40, target_compute=0.10))
    assert policy.costs.wait(True) == pytest.approx(0.08)
    assert policy.costs.wait(False) == pytest.approx(0.003)
    for _ in range(200):
        policy.update(RoundReport(0, 0, 0.0, 0.05 + 0.003, step_tokens=8, target_compute=0.05))
    assert policy.costs.wait(True) == pytest.approx(0.003)  # not measured lately: the others'


def test_adaptive_lookahead_prices_the_drafts_step_for_everyone_drafting():
    """The draft service reports the steps that ran a proposal and their tokens, all sessions'
    (ProposeResponse.steps, step_tokens), and the policy fits the draft's step cost over them.
    A draft that batches nothing (10 ms a session in the step, as the llama.cpp draft measures
    on one core) is cheap for a round drafting alone and dear when 16 generations all draft:
    at load 16 no speculation pays. Measured by rounds drafting alone only, its cost would be
    the lone one, and speculation would look like it pays."""

    def policy(drafting: tuple[int, ...], load: int) -> AdaptiveLookahead:
        policy = AdaptiveLookahead(k_max=8, load=lambda: load)
        for i in range(60):
            k, sessions = (2, 4)[i % 2], drafting[i % len(drafting)]
            compute = 0.010 * sessions * k
            draft = DraftCost(compute + 0.001, k, compute, steps=k, step_tokens=k * sessions)
            step = 16 * (k + 1)
            target = 0.05 + 0.001 * (step - 1)
            policy.update(RoundReport(k, 3 * k // 4, draft, target, step_tokens=step, target_compute=target))
        return policy

    measured = policy((1, 4, 16), load=16)
    assert measured.costs.draft_line.fit() == pytest.approx((0.010, 0.010))
    assert measured.costs.draft_cost(16) == pytest.approx(0.160 + 0.001 / 3, abs=1e-4)  # + the RPC a token
    assert measured._best_k() == 0
    assert policy((1, 4, 16), load=1)._best_k() >= 2
    # Measured by lone rounds only, its batching is unknown and priced as none: 16 sessions'
    # step as 16 of one (it used to be priced as one: speculation looked cheap at load 16).
    alone = policy((1,), load=16)
    assert alone.costs.draft_line.fit() is None
    assert alone.costs.draft_cost(16) == pytest.approx(16 * alone.costs.draft_cost(1))
    assert alone._best_k() == 0
    assert policy((1,), load=1)._best_k() >= 2


def test_under_load_speculation_switches_only_outside_a_band():
    """Near break-even the model's error decides, and every switch costs (a continuation
    dropped, sessions out of step): the first decision goes by the gain, later ones switch only
    outside 1 +- MARGIN."""
    assert speculates(1.05, None) and not speculates(0.95, None)
    assert speculates(1 - MARGIN / 2, True) and not speculates(1 - 2 * MARGIN, True)
    assert not speculates(1 + MARGIN / 2, False) and speculates(1 + 2 * MARGIN, False)


def test_a_wave_of_prefills_does_not_make_speculation_look_cheap():
    """The first rounds of a wave of 16 new generations go without speculation and wait behind
    the others' prefills, seconds beyond their step. Priced as what every round without
    speculation waits, that made speculation look cheap, and once it ran no round without it
    measured the wait again. A wait counts up to two steps, and a round without speculation is
    priced as waiting no longer than a speculating one: here (a draft that batches nothing, 10 ms a
    session in its step) no speculation at load 16."""
    policy = AdaptiveLookahead(k_max=8, load=lambda: 16)
    for _ in range(16):  # the wave: each first round waits 3 s for the prefills
        policy.update(RoundReport(0, 0, 0.0, 3.0 + 0.08, step_tokens=16, target_compute=0.08))
    assert policy.costs.wait(False) == pytest.approx(0.16)  # two steps
    for i in range(64):
        k, sessions = (2, 4)[i % 2], (1, 16)[i % 4 // 2]
        compute = 0.010 * sessions * k
        step = 16 * (k + 1)
        target = 0.05 + 0.002 * (step - 1)
        draft = DraftCost(compute + 0.001, k, compute, steps=k, step_tokens=k * sessions)
        policy.update(RoundReport(k, 3 * k // 4, draft, target + 0.005, step_tokens=step, target_compute=target))
    assert policy.costs.wait(False) > 0.05 > policy.costs.wait(True)  # the wave's, still there
    assert policy._best_k() == 0


def test_a_round_costs_its_own_path_or_the_busier_devices_work():
    """A round of one of N generations takes the longest of its own path (overlapped: the verify
    beside the continuation's k + 1 draft steps, then k fresh ones after a rejection;
    sequential: the sum), the target's work and the draft's work for a round of all N. Alone the
    path is the longest; under load a device's work can be. The target's work is N / s steps
    of s blocks each, s the generations whose blocks share a verify step: all N in lockstep;
    fewer when their rounds drift apart (more steps, each paying the step's fixed cost)."""
    a, k, d = 0.9, 2, 0.040
    line = (0.050, 0.004)  # the target's step: 50 ms + 4 ms a token fed

    def step(m):
        return 0.050 + 0.004 * (m - 1)

    rejected = (1 - a ** (k + 1)) * k * d
    alone = RoundCosts(d, line, wait=0.010)
    assert round_time(a, k, alone, True) == pytest.approx(max(step(3) + 0.010, 3 * d) + rejected)
    assert round_time(a, k, alone, False) == pytest.approx(k * d + step(3) + 0.010)
    lockstep = RoundCosts(d, line, load=8, sessions=8)
    assert round_time(a, k, lockstep, True) == pytest.approx(max(step(24), 3 * d) + rejected)
    apart = RoundCosts(d, line, load=8, sessions=2)  # four verify steps of two blocks each
    assert round_time(a, k, apart, True) == pytest.approx(4 * step(6))
    slow_draft = RoundCosts(0.100, line, load=8, sessions=8)
    assert round_time(a, k, slow_draft, False) == pytest.approx(k * 0.100 + step(24))  # lockstep: the sum
    # t0: a step of eight one-token rounds
    assert speedup(a, k, lockstep, True, step(8)) > 1 > speedup(a, 1, apart, True, step(8))


def test_under_load_speculation_stops_when_the_generations_verify_apart():
    """8 generations, a draft that batches nothing (12 ms a session: 96 ms a step of all 8), a
    target step of 100 ms + 4 ms a token, acceptance ~0.85. While the speculating rounds' verify
    steps hold all 8, overlapped k = 1 pays; when the target reports steps of 2 of them (their
    rounds drifted apart: measured at 8 and 16 clients, steps of 2-3 sessions), the target runs
    four steps a round and no k pays."""

    def policy(sessions: int) -> AdaptiveLookahead:
        policy = AdaptiveLookahead(k_max=8, overlap=True, load=lambda: 8)
        for i in range(60):
            k = (2, 4)[i % 2]
            draft = DraftCost(0.096 * k, k, 0.096 * k, steps=k, step_tokens=8 * k)
            tokens = sessions * (k + 1)
            target = 0.100 + 0.004 * (tokens - 1)
            policy.update(RoundReport(k, k - (i % 4 < 2), draft, target, tokens, target, step_sessions=sessions))
        as_priced(policy.costs, 8)
        return policy

    together = policy(8)
    assert together._best_k() == 1 and together.overlapping
    assert together.costs.sessions(8) == pytest.approx(8)
    apart = policy(2)
    assert apart.costs.sessions(8) == pytest.approx(2)
    assert apart._best_k() == 0
    # An exploration rides in everyone's step: its round says nothing of the sessions per step.
    apart.exploring = True
    apart.update(RoundReport(2, 2, DraftCost(0.08, 2, 0.08, 2, 16), 0.1, 24, 0.1, step_sessions=8))
    assert apart.costs.sessions(8) == pytest.approx(2)


def test_a_draft_queued_behind_prefills_is_priced_by_its_step():
    """A proposal that waited behind the draft's prefills of a wave of new prompts (seconds,
    beyond its steps' compute) says nothing of the rounds to come: its wait counts up to two of
    its computes, as the target's does. Uncapped, a burst of 16 clients left the draft priced at
    100 ms a token when the load fell to 2 (its step: 31 ms), and speculation stayed off."""
    costs = PairCosts()
    costs.update(RoundReport(2, 2, DraftCost(3.0, 2, 0.02, steps=2, step_tokens=2), 0.06, 3, 0.06))
    assert costs.draft_cost(1) == pytest.approx((0.02 + 0.04) / 2)


def test_a_draft_step_is_priced_by_its_services_profile():
    """The draft service times its batched step for 1..16 sessions at start (Describe's
    step_costs). The curve is far from a line (the default Q8_0 draft on one core: 8, 25, 34,
    40, 88 ms): a line fitted over the steps of 1-4 sessions that a pair's first clients ran
    priced a step of 8 at about twice its cost, and speculation at 8 clients looked too dear to
    take. With a profile, a step of n is the profile's, interpolated, scaled by what the live
    steps measured against it (a service's handlers share its core); steps beside a prompt's
    prefill do not scale it; past the largest size no batching is assumed."""
    profile = {1: 0.008, 2: 0.025, 4: 0.034, 8: 0.040, 16: 0.088}
    assert profiled(profile, 0.5) == profiled(profile, 1) == 0.008
    assert profiled(profile, 6) == pytest.approx(0.037)
    assert profiled(profile, 32) == pytest.approx(0.176)

    def measured(costs: PairCosts, quiet: bool = True, scale: float = 1.25) -> PairCosts:
        for i in range(40):
            sessions, k = (1, 2, 4)[i % 3], 4
            compute = scale * profiled(profile, sessions) * k
            draft = DraftCost(compute, k, compute, steps=k, step_tokens=k * sessions)
            costs.update(RoundReport(k, k, draft, 0.06, 5, 0.06, quiet=quiet))
        return costs

    priced, line = measured(PairCosts(profile)), measured(PairCosts())
    assert priced.draft_step(8) == pytest.approx(1.25 * 0.040)
    assert priced.draft_step(16) == pytest.approx(1.25 * 0.088)
    assert priced.draft_cost(8) == pytest.approx(1.25 * 0.040)  # nothing waited beyond the compute
    assert line.draft_step(8) > 1.5 * priced.draft_step(8)  # the line's extrapolation
    assert measured(PairCosts(profile), quiet=False).draft_step(8) == pytest.approx(0.040)
    assert PairCosts(profile).draft_step(8) is None  # no round yet: _best_k starts from k_max
