"""Turns at the target (orchestrator.turns): a pair's Scores wait for the drafts due back soon, so a
turn of a few joins the next instead of taking a step of its own; nothing else is held.

The policy is checked on its own with given times (when a Score waits, for how long, and that it never
waits past two target steps or for a draft that is overdue), then through a real step stream on
loopback: a Score held for three drafts leaves in one message with their Scores, and a Score held for
drafts that never come back (a hung draft) still gets its answer.
"""

from __future__ import annotations

import time

import grpc
import pytest

from orchestrator import scheduler
from orchestrator.scheduler import SCHEDULER
from orchestrator.step_link import StepLink
from orchestrator.turns import (
    HOLD_SHARE,
    MOST_STEPS,
    SLACK_SHARE,
    SPLIT_LEAST,
    SPLIT_SHARE,
    TURN_SLACK,
    Flights,
    Turns,
)
from specdec.v1 import model_pb2
from tests.test_scheduler import _Steps, later, serve_steps

STEP = 0.1  # the target's step, seconds (its messages' latency)
DRAFT = 0.03  # the draft's messages' latency


def turns_at(now: float, draft: float = DRAFT) -> Turns:
    """A pair whose target answers in STEP and draft in `draft`, nothing in flight at `now`."""
    turns = Turns()
    turns.target.sent([1], now - STEP)
    turns.target.back([1], now)
    turns.draft.sent([2], now - draft)
    turns.draft.back([2], now)
    assert (turns.target.latency, turns.draft.latency) == (pytest.approx(STEP), pytest.approx(draft))
    return turns


def test_a_score_leaves_at_once_with_nothing_drafting_or_more_scores_than_drafts():
    turns = turns_at(0.0)
    assert turns.hold_until(1, 0.0, 0.0) is None  # speculation off, or alone: nothing to wait for
    turns.draft.sent([10, 11], 0.0)
    assert turns.hold_until(3, 0.0, 0.0) is None  # three Scores, two drafts: no turn to join
    assert Turns().hold_until(1, 0.0, 0.0) is None  # the target's step not measured yet


def test_a_few_scores_wait_for_the_drafts_due_back_soon_and_their_scores():
    turns = turns_at(0.0)
    turns.draft.sent([10, 11, 12], 0.0)  # due back at DRAFT
    assert DRAFT <= HOLD_SHARE * STEP
    assert turns.hold_until(2, 0.0, 0.0) == pytest.approx(DRAFT + SLACK_SHARE * STEP)
    turns.target.sent([20], 0.0)  # a step of the target's in flight: decided again when it ends
    assert turns.hold_until(2, 0.0, 0.0) == pytest.approx(STEP)
    turns.target.drop([20])
    turns.draft.back([10, 11, 12], DRAFT)  # the drafts came back: their Scores go with the held ones
    assert turns.hold_until(2, DRAFT, DRAFT) is None


def test_a_score_does_not_wait_for_drafts_due_late_overdue_or_past_two_steps():
    turns = turns_at(0.0)
    turns.draft.sent([10, 11], 0.0)
    # due back later than half a step from now
    assert turns.hold_until(1, 0.0, DRAFT - HOLD_SHARE * STEP - 0.001) is None
    # overdue by more than the slack: a hung or lost draft is not waited for
    assert turns.hold_until(1, 0.0, DRAFT + SLACK_SHARE * STEP + 0.001) is None
    # waited two target steps already: it leaves, whatever drafts
    turns.target.sent([20], 0.0)
    assert turns.hold_until(1, MOST_STEPS * STEP - 0.001, 0.0) is not None
    assert turns.hold_until(1, MOST_STEPS * STEP, 0.0) is None


def test_a_turn_of_every_session_splits_in_two_and_two_halves_stay_as_they_are():
    turns = turns_at(0.0, draft=STEP)  # drafts as long as a target step: a turn's drafts leave the target idle
    pair = [f"s{i}" for i in range(64)]
    first = turns.leaving(pair, drafted=True)
    assert first == 32 + TURN_SLACK  # the rest wait for the next turn ...
    assert turns.leaving(pair[first:], drafted=True) == 64 - first  # ... and go whole in it
    for _ in range(3):  # from then on two turns, neither split
        assert turns.leaving(pair[:first], drafted=True) == first
        assert turns.leaving(pair[first:], drafted=True) == 64 - first


def test_a_turn_is_not_split_without_drafts_below_the_least_or_where_drafts_are_short():
    pair = [f"s{i}" for i in range(64)]
    assert turns_at(0.0, draft=STEP).leaving(pair, drafted=False) == 64  # plain rounds: every session each step
    assert turns_at(0.0, draft=STEP).leaving(pair[: SPLIT_LEAST - 1], drafted=True) == SPLIT_LEAST - 1
    short = SPLIT_SHARE * STEP * 0.9  # the drafts and the rest of a round fit in the target's step
    assert turns_at(0.0, draft=short).leaving(pair, drafted=True) == 64
    assert Turns().leaving(pair, drafted=True) == 64  # nothing measured yet


def test_flights_count_calls_not_back_and_time_a_message_by_its_first_result():
    flights = Flights()
    flights.sent([1, 2, 3], 10.0)
    flights.back([2], 10.5)
    flights.back([1], 11.0)  # the same message: its latency was taken at its first result
    assert (flights.in_flight(), flights.latency) == (1, pytest.approx(0.5))
    flights.drop([3, 99])  # cancelled, or failed with its stream; an unknown id changes nothing
    assert flights.in_flight() == 0
    assert flights.due(11.0, 1.0, 1.0) == (0, 11.0)


@pytest.fixture(params=[DRAFT])
def link(request):
    """A StepLink with turns, on the target's side, to a Steps handler on loopback that answers each
    call at once and records each message's size; (link, turns, handler). Its drafts take DRAFT, or
    what the test's `indirect` parameter says."""
    handler = _Steps()
    server, port = serve_steps(handler)
    turns = turns_at(time.monotonic(), draft=request.param)
    link = StepLink(grpc.insecure_channel(f"127.0.0.1:{port}"), "test.Steps", turns=turns, side="target")
    try:
        yield link, turns, handler
    finally:
        link.close()
        server.stop(None)


def scored(link: StepLink, length: int, drafts: tuple[int, ...] = ()) -> int:
    ref = model_pb2.SessionRef(session_id=f"s{length}", expected_length=length)
    request = model_pb2.ScoreRequest(session=ref, draft_token_ids=drafts)
    return link.future("Score", "score", request, timeout=10).result().length


def test_a_held_score_leaves_in_one_message_with_the_scores_of_the_drafts_it_waited_for(link):
    link, turns, handler = link
    with turns.lock:
        turns.draft.sent([101, 102, 103], time.monotonic())  # three sessions drafting, due back in DRAFT

    def round_of_four() -> list[int]:
        first = SCHEDULER.spawn(scored, link, 1)
        scheduler.result(later(DRAFT / 2))  # the drafts come back while the first Score waits
        with turns.lock:
            turns.draft.back([101, 102, 103], time.monotonic())
        others = [SCHEDULER.spawn(scored, link, n) for n in (2, 3, 4)]
        return [first.result()] + [other.result() for other in others]

    assert SCHEDULER.run(round_of_four) == [1, 2, 3, 4]
    assert handler.sizes == [4]  # without turns: [1, 3]


def test_a_score_held_for_a_hung_draft_still_gets_its_answer(link):
    link, turns, handler = link
    with turns.lock:
        turns.draft.sent([101, 102], time.monotonic())  # drafting, and never back
    assert SCHEDULER.run(scored, link, 7) == 7
    assert handler.sizes == [1]


@pytest.mark.parametrize("link", [STEP], indirect=True)
def test_scores_after_drafts_made_together_leave_in_two_turns_and_all_get_their_answers(link):
    link, _, handler = link
    sessions = 2 * SPLIT_LEAST

    def together() -> list[int]:
        tasks = [SCHEDULER.spawn(scored, link, n, (7, 8)) for n in range(sessions)]
        return [task.result() for task in tasks]

    assert SCHEDULER.run(together) == list(range(sessions))
    half = sessions // 2 + TURN_SLACK
    assert handler.sizes == [half, sessions - half]  # without the split: [32]
