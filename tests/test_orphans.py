"""No orphaned sessions: storms of requests whose client stops waiting at every moment of a
generation (short deadlines, cancelled streams) leave no session and no KV-cache token behind
on either service, so they never exhaust the session or KV limits.

Each storm is followed by a bound on a state change: within 2 s both services hold zero
sessions and zero KV tokens, and an ordinary request is served. The models are the tiny
ones slowed to 20 ms a forward pass, so a deadline of 10-200 ms ends a request anywhere from
before its OpenSession reaches a service to the middle of its rounds.
"""

from __future__ import annotations

import queue
import random
import time

import grpc
import pytest

from specdec.errors import Cancelled, NotFound
from specdec.limits import AdmissionLimits, SessionLimits
from specdec.runtime.engine import SessionEngine
from specdec.v1 import model_pb2
from target_service.server import TargetServicer
from tests.harness import long_request, slow_pipeline, wait_until
from tests.standins import Waiting

Code = grpc.StatusCode
# The storm is wider than max_sessions (64): some requests are refused with RESOURCE_EXHAUSTED
# while others hold sessions, which a leak would then hold for good.
STORM = 240
CLEAN_WITHIN = 2.0


@pytest.fixture
def storm_pipeline(tiny_backends):
    # Admission wide enough that the whole storm reaches the model services at once.
    admission = AdmissionLimits(max_concurrent=STORM, max_queue=STORM)
    with slow_pipeline(tiny_backends, delay=0.02, admission=admission) as p:
        yield p


def held(p) -> dict[str, tuple[int, int]]:
    """(open sessions, KV tokens) on each service."""
    infos = {side: stub.Describe(model_pb2.DescribeRequest(), timeout=10) for side, stub in
             (("draft", p.draft), ("target", p.target))}  # fmt: skip
    return {side: (info.open_sessions, info.kv_tokens) for side, info in infos.items()}


def assert_clean_and_serving(p) -> None:
    clean = {"draft": (0, 0), "target": (0, 0)}
    wait_until(lambda: held(p) == clean, CLEAN_WITHIN)
    assert held(p) == clean, f"left behind (sessions, KV tokens): {held(p)}"
    assert p.orchestrator.Generate(long_request(8), timeout=60).finish_reason == "length"
    assert held(p) == clean


@pytest.mark.slow
def test_short_deadline_storm_leaves_no_session(storm_pipeline):
    p, rng = storm_pipeline, random.Random(14)
    calls = [p.orchestrator.Generate.future(long_request(400), timeout=rng.uniform(0.01, 0.2)) for _ in range(STORM)]
    codes = {call.exception().code() if call.exception() else Code.OK for call in calls}
    assert codes <= {Code.DEADLINE_EXCEEDED, Code.RESOURCE_EXHAUSTED}, codes
    assert_clean_and_serving(p)


@pytest.mark.slow
def test_cancelled_stream_storm_leaves_no_session(storm_pipeline):
    p, rng = storm_pipeline, random.Random(15)
    streams = [p.orchestrator.GenerateStream(long_request(400), timeout=60) for _ in range(STORM)]
    start = time.monotonic()
    for when, stream in sorted(((rng.uniform(0, 0.2), s) for s in streams), key=lambda pair: pair[0]):
        time.sleep(max(0.0, start + when - time.monotonic()))
        stream.cancel()
    codes = {stream.code() for stream in streams}
    assert codes <= {Code.CANCELLED, Code.RESOURCE_EXHAUSTED}, codes
    assert_clean_and_serving(p)


def test_service_reaps_sessions_whose_opener_left(tiny_backends):
    """A caller that gives up on OpenSession and never closes (no orchestrator to do it):
    the service closes what it opened for nobody. Mostly at once (the call ended before the
    answer); an answer that was sent but reached no one (the service's deadline runs from
    when the request arrived, a little after the caller's) is reaped when its session stays
    unused (here after 0.5 s; by default 30 s)."""
    with slow_pipeline(tiny_backends, delay=0.02, limits=SessionLimits(unclaimed_ttl=0.5)) as p:
        _open_and_leave(p)


def test_sessions_of_a_step_stream_that_ended_are_reaped_as_unclaimed(tiny_backends):
    """An orchestrator killed mid-generation (`specdec serve` starts a new one) never closes the
    sessions it held: they held the service's slots and KV budget for the idle TTL (300 s). Those
    its step stream opened and did not close are reaped once its stream ends, after the unclaimed
    TTL (a session opened unary and stepped on it too: a constrained one, whose grammar compiles off
    the stream); a session opened otherwise and never stepped on it stays."""
    with slow_pipeline(tiny_backends, limits=SessionLimits(unclaimed_ttl=0.3)) as p:
        calls: queue.SimpleQueue = queue.SimpleQueue()
        stream = p.target.Steps(iter(calls.get, None))
        ids = ("a", "b", "closed")
        opens = [model_pb2.StepCall(id=i, open_session=_open(sid)) for i, sid in enumerate(ids)]
        calls.put(model_pb2.StepCalls(calls=opens))
        close = model_pb2.StepCall(id=9, close_session=model_pb2.CloseSessionRequest(session_id="closed"))
        assert _results(stream, 3) == {0: 0, 1: 0, 2: 0}
        calls.put(model_pb2.StepCalls(calls=[close]))
        assert _results(stream, 1) == {9: 0}
        p.target.OpenSession(_open("unary"))
        p.target.OpenSession(_open("constrained"))  # unary, as a session with a grammar opens, then stepped here:
        score = model_pb2.ScoreRequest(session=model_pb2.SessionRef(session_id="constrained", expected_length=2))
        calls.put(model_pb2.StepCalls(calls=[model_pb2.StepCall(id=10, score=score)]))
        assert _results(stream, 1) == {10: 0}
        for sid in ("a", "b", "unary"):  # each used: claimed, as a generation's sessions are
            p.target.GetSession(model_pb2.GetSessionRequest(session_id=sid))
        time.sleep(0.6)  # two unclaimed TTLs: nothing reaped while the stream lives
        assert held(p)["target"][0] == 4
        stream.cancel()  # as a killed orchestrator's connection ends
        assert wait_until(lambda: held(p)["target"][0] == 1, 10), held(p)
        assert p.target.GetSession(model_pb2.GetSessionRequest(session_id="unary")).length == 2
        for sid in ("a", "constrained"):
            with pytest.raises(grpc.RpcError) as err:
                p.target.GetSession(model_pb2.GetSessionRequest(session_id=sid))
            assert err.value.code() == Code.NOT_FOUND


def test_a_call_in_flight_when_its_stream_ends_leaves_its_session_unclaimed(tiny_backends):
    """A session's call running when its stream ends (cancelled between forwards: a target's plain
    round of several steps, a constrained one) ends after the stream's sessions were disowned: it
    used to claim its session again on the way out, which then held its slot for the idle TTL
    (300 s) instead of the unclaimed one."""
    with slow_pipeline(tiny_backends, delay=0.5, limits=SessionLimits(unclaimed_ttl=3.0)) as p:
        calls: queue.SimpleQueue = queue.SimpleQueue()
        stream = p.target.Steps(iter(calls.get, None))
        calls.put(model_pb2.StepCalls(calls=[model_pb2.StepCall(id=1, open_session=_open("a"))]))
        assert _results(stream, 1) == {1: 0}
        score = model_pb2.ScoreRequest(session=model_pb2.SessionRef(session_id="a", expected_length=2))
        calls.put(model_pb2.StepCalls(calls=[model_pb2.StepCall(id=2, score=score)]))
        assert _results(stream, 1) == {2: 0}  # used: claimed
        score.decode_steps, score.logprobs = 8, 0  # 8 forwards of 0.5 s, one by one
        calls.put(model_pb2.StepCalls(calls=[model_pb2.StepCall(id=3, score=score)]))
        time.sleep(1.2)  # inside its third forward or so: 4 s in all
        stream.cancel()
        assert wait_until(lambda: held(p)["target"][0] == 0, 15), held(p)


def _open(session_id: str) -> model_pb2.OpenSessionRequest:
    return model_pb2.OpenSessionRequest(session_id=session_id, prompt_token_ids=[3, 4])


def _results(stream, n: int) -> dict[int, int]:
    """The next `n` results of a step stream: call id -> status code."""
    got: dict[int, int] = {}
    while len(got) < n:
        got.update({r.id: r.code for r in next(stream).results})
    return got


def _open_and_leave(p) -> None:
    rng = random.Random(16)
    request = model_pb2.OpenSessionRequest(prompt_token_ids=list(range(3, 30)))
    calls = []
    for i in range(100):
        request.session_id = f"left-{i}"
        stub = p.draft if i % 2 else p.target
        calls.append(stub.OpenSession.future(request, timeout=rng.uniform(0.001, 0.05)))
    # Most give up before their answer; an open that beats its deadline is a session nobody
    # uses either, and is reaped as unclaimed: either way none may be left.
    assert sum(call.exception() is not None for call in calls) >= len(calls) // 2
    assert_clean_and_serving(p)


def open_overtaken_by_close(tiny_backends, close_first: bool):
    """OpenSession on a real servicer, with a CloseSession of the same id arriving before the
    open (close_first: the recovery's close-then-reopen) or while it runs (a caller that
    gave up on the open); returns (open's error or None, sessions left)."""
    servicer = TargetServicer(SessionEngine(tiny_backends["target"], "target"))
    close = model_pb2.CloseSessionRequest(session_id="s")
    if close_first:
        with pytest.raises(NotFound):
            servicer.CloseSession(close, Waiting())
    else:
        real_open = servicer.engine.open

        def overtaken(*args, **options):
            with pytest.raises(NotFound):
                servicer.CloseSession(close, Waiting())
            return real_open(*args, **options)

        servicer.engine.open = overtaken
    try:
        servicer.OpenSession(model_pb2.OpenSessionRequest(session_id="s", prompt_token_ids=[3, 4, 5]), Waiting())
        error = None
    except Cancelled as err:
        error = err
    return error, servicer.engine.open_sessions


def test_close_that_overtakes_its_open_leaves_no_session(tiny_backends):
    error, left = open_overtaken_by_close(tiny_backends, close_first=False)
    assert isinstance(error, Cancelled) and left == 0


def test_close_then_open_of_the_same_id_opens(tiny_backends):
    assert open_overtaken_by_close(tiny_backends, close_first=True) == (None, 1)


def test_unclaimed_ttl_reaps_only_sessions_never_used(tiny_backends):
    limits = SessionLimits(unclaimed_ttl=0.3)
    with slow_pipeline(tiny_backends, limits=limits) as p:
        for sid in ("used", "unused"):
            p.target.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[3, 4]))
        p.target.GetSession(model_pb2.GetSessionRequest(session_id="used"))
        assert wait_until(lambda: held(p)["target"][0] == 1, 5)
        time.sleep(0.6)  # two more unclaimed TTLs: the used session stays
        assert p.target.GetSession(model_pb2.GetSessionRequest(session_id="used")).length == 2
        p.target.CloseSession(model_pb2.CloseSessionRequest(session_id="used"))
