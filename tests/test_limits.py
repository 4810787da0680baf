"""Limits: session and KV caps on the model services, the idle-session TTL, and the
orchestrator's admission limit with its bounded queue. Beyond a limit a request gets
RESOURCE_EXHAUSTED at once; what was admitted completes."""

from __future__ import annotations

import threading

import grpc
import pytest

from specdec.limits import AdmissionLimits, SessionLimits
from specdec.runtime.llamacpp import LLAMA_MAX_SEQ, SEQUENCE_CELLS, _check_memory, sessions_for
from specdec.v1 import model_pb2, orchestrator_pb2
from tests.harness import long_request, pipeline, slow_pipeline, status_of, wait_until

Code = grpc.StatusCode


def open_request(sid, n):
    return model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[5] * n)


def close(stub, *sids):
    for sid in sids:
        stub.CloseSession(model_pb2.CloseSessionRequest(session_id=sid))


def test_session_cap(tiny_backends):
    with pipeline(tiny_backends["draft"], tiny_backends["target"], limits=SessionLimits(max_sessions=2)) as p:
        for stub in (p.draft, p.target):
            stub.OpenSession(open_request("one", 3))
            stub.OpenSession(open_request("two", 3))
            err = status_of(lambda s=stub: s.OpenSession(open_request("three", 3)))
            assert err.code() == Code.RESOURCE_EXHAUSTED and "max_sessions 2" in err.details()
        # The orchestrator passes the refusal on, and opened nothing it did not close.
        err = status_of(lambda: p.orchestrator.Generate(long_request(8)))
        assert err.code() == Code.RESOURCE_EXHAUSTED and "max_sessions" in err.details()
        for stub in (p.draft, p.target):
            close(stub, "one")
        assert p.orchestrator.Generate(long_request(8)).finish_reason == "length"
        for stub in (p.draft, p.target):
            close(stub, "two")
        assert p.open_sessions() == (0, 0)


def test_kv_token_cap(tiny_backends):
    limits = SessionLimits(max_kv_tokens=40)
    with pipeline(tiny_backends["draft"], tiny_backends["target"], limits=limits) as p:
        target = p.target
        target.OpenSession(open_request("big", 30))  # holds 29
        err = status_of(lambda: target.OpenSession(open_request("more", 20)))
        assert err.code() == Code.RESOURCE_EXHAUSTED and "max_kv_tokens 40" in err.details()
        # A block that would take the cache past the budget is refused before anything changes.
        before = target.GetSession(model_pb2.GetSessionRequest(session_id="big"))
        score = model_pb2.ScoreRequest(
            session=model_pb2.SessionRef(session_id="big", expected_length=30),
            append_tokens=[6] * 8,
            draft_token_ids=[7] * 4,
        )
        err = status_of(lambda: target.Score(score))
        assert err.code() == Code.RESOURCE_EXHAUSTED
        assert target.GetSession(model_pb2.GetSessionRequest(session_id="big")) == before
        close(target, "big")
        target.OpenSession(open_request("more", 20))  # the budget came back
        close(target, "more")
        # A generation that outgrows the budget fails cleanly: no session is left behind.
        err = status_of(lambda: p.orchestrator.Generate(long_request(100)))
        assert err.code() == Code.RESOURCE_EXHAUSTED and "max_kv_tokens" in err.details()
        assert p.open_sessions() == (0, 0)
        assert p.orchestrator.Generate(long_request(30)).finish_reason == "length"


def test_a_generation_admitted_is_never_refused_the_budget_mid_way(tiny_backends):
    """Two streams that fit the KV budget one at a time: each session reserves its whole answer at
    open, so one runs to its end and the other is refused at once, before any token. Before, both
    opened with their prompts' room, grew together, and one failed mid-answer ("KV cache budget: ...
    needs 5 more; retry later") after streaming tokens a client cannot resume."""
    prompt = len(long_request(1).token_ids.ids)
    limits = SessionLimits(max_kv_tokens=prompt + 100)  # one answer of 64, not two
    with pipeline(tiny_backends["draft"], tiny_backends["target"], limits=limits) as p:
        for _ in range(3):
            streams = [p.orchestrator.GenerateStream(long_request(64)) for _ in range(2)]
            outcomes = []
            for stream in streams:
                chunks = []
                try:
                    chunks.extend(stream)
                    outcome = ("done", chunks[-1].finish_reason)
                except grpc.RpcError as err:
                    outcome = (err.code(), "max_kv_tokens" in err.details())
                outcomes.append((outcome[0], sum(len(c.token_ids) for c in chunks), outcome[1]))
            assert ("done", 64, "length") in outcomes, outcomes
            assert all(o in (("done", 64, "length"), (Code.RESOURCE_EXHAUSTED, 0, True)) for o in outcomes), outcomes
            assert p.sessions_freed_within(10)


def test_the_orchestrator_runs_the_generations_its_target_holds_and_queues_the_rest(tiny_backends):
    """A target that holds 2 sessions under an orchestrator whose own limit is 64: it says so
    (Describe, `specdec status`), and 5 generations at once all finish with the target's greedy
    text, 2 at a time, the rest queued; before, the third failed RESOURCE_EXHAUSTED from the target."""
    with slow_pipeline(tiny_backends, limits=SessionLimits(max_sessions=2)) as p:
        assert p.target.Describe(model_pb2.DescribeRequest()).max_sessions == 2
        info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10)
        assert (info.max_concurrent, info.max_queue) == (2, AdmissionLimits().max_queue)
        alone = p.orchestrator.Generate(long_request(24, speculation=orchestrator_pb2.SpeculationParams(disabled=True)))
        calls = [p.orchestrator.Generate.future(long_request(24)) for _ in range(5)]
        assert [c.result(timeout=120).token_ids for c in calls] == [alone.token_ids] * 5
        assert p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10).refused == 0
        assert p.sessions_freed_within(10)


def test_a_llamacpp_context_holds_the_sessions_its_kv_budget_fills():
    """A llama.cpp context gives each session a stream of SEQUENCE_CELLS cells, allocated at start:
    it holds --max-sessions of them, no more than --max-kv-tokens fills, at most llama.cpp's bound."""
    assert sessions_for(SessionLimits()) == 65_536 // SEQUENCE_CELLS == 16
    assert sessions_for(SessionLimits(max_sessions=4)) == 4
    assert sessions_for(SessionLimits(max_sessions=64, max_kv_tokens=64 * SEQUENCE_CELLS)) == 64
    assert sessions_for(SessionLimits(max_sessions=64, max_kv_tokens=SEQUENCE_CELLS // 2)) == 1
    assert sessions_for(SessionLimits(max_sessions=1000, max_kv_tokens=0)) == LLAMA_MAX_SEQ
    # A cache the machine cannot hold is refused at start, naming the flags, before llama.cpp allocates it.
    _check_memory(16 * SEQUENCE_CELLS * 46_080, 16, SEQUENCE_CELLS)  # the default target's: ~2.8 GiB
    with pytest.raises(ValueError, match="lower --max-sessions or --max-kv-tokens"):
        _check_memory(2**60, LLAMA_MAX_SEQ, SEQUENCE_CELLS)


@pytest.mark.slow
def test_idle_sessions_are_reaped_and_busy_ones_are_not(tiny_backends):
    limits = SessionLimits(idle_ttl=1.0)
    with slow_pipeline(tiny_backends, 0.02, limits=limits) as p:
        p.draft.OpenSession(open_request("forgotten", 4))
        # A generation that lasts several TTLs keeps its sessions: they are never idle that long.
        reply = p.orchestrator.Generate(long_request(120, speculation=orchestrator_pb2.SpeculationParams(lookahead=1)))
        assert reply.finish_reason == "length" and reply.stats.wall_seconds > limits.idle_ttl
        # The forgotten session goes (a bound on a state change: the reaper runs every TTL/4).
        assert wait_until(lambda: p.open_sessions() == (0, 0), 10 * limits.idle_ttl)
        err = status_of(lambda: p.draft.GetSession(model_pb2.GetSessionRequest(session_id="forgotten")))
        assert err.code() == Code.NOT_FOUND


@pytest.fixture
def one_slot(tiny_backends):
    """An orchestrator that runs one generation at a time and queues one more, over slow models."""
    with slow_pipeline(tiny_backends, admission=AdmissionLimits(max_concurrent=1, max_queue=1)) as p:
        yield p


@pytest.mark.slow
def test_admission_refuses_the_excess_and_completes_the_admitted(one_slot):
    p = one_slot
    running = p.orchestrator.GenerateStream(long_request(80))
    first = next(running)  # admitted and generating
    done = threading.Event()
    calls = [p.orchestrator.Generate.future(long_request(10)) for _ in range(2)]
    for call in calls:
        call.add_done_callback(lambda _: done.set())
    assert done.wait(60)
    # One of the two is queued, the other refused while the first still streams.
    refused = [c for c in calls if c.done()]
    assert len(refused) == 1 and refused[0].code() == Code.RESOURCE_EXHAUSTED, refused[0].details()
    assert "max_concurrent 1" in refused[0].details() and not running.done()
    info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10)  # what `specdec status` shows
    assert (info.running, info.max_concurrent, info.queued, info.max_queue, info.refused) == (1, 1, 1, 1, 1)
    chunks = [first, *running]
    assert sum(len(c.token_ids) for c in chunks) == 80 and chunks[-1].finish_reason == "length"
    queued = next(c for c in calls if c is not refused[0])
    assert queued.result(timeout=120).finish_reason == "length"
    assert p.open_sessions() == (0, 0)


@pytest.mark.slow
def test_a_cancelled_request_leaves_the_queue(one_slot):
    p = one_slot
    admission = p.servers["orchestrator"].gate.admission
    running = p.orchestrator.GenerateStream(long_request(80))
    next(running)
    queued = p.orchestrator.Generate.future(long_request(10))
    assert wait_until(lambda: admission.waiting == 1, 30)
    queued.cancel()
    assert wait_until(lambda: admission.waiting == 0, 5)
    # The queue has room again: this one waits for the slot instead of being refused.
    again = p.orchestrator.Generate.future(long_request(10))
    assert wait_until(lambda: admission.waiting == 1, 30)
    assert sum(len(c.token_ids) for c in running) > 0
    assert again.result(timeout=120).finish_reason == "length"
    assert p.open_sessions() == (0, 0)
