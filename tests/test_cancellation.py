"""Abandoned requests: a cancelled request, a client that disconnects from a stream, or a
deadline that passes frees the sessions in both services within 1 s; the deadline bounds
the whole generation and is passed on to the model services; a model service killed
mid-stream gives the client UNAVAILABLE within its deadline.

The sessions-freed checks poll Describe.open_sessions with a 1 s bound: a bound on a state
change, not a speed measurement. The models are the tiny ones slowed to ~10 ms a forward
pass so that a generation is still running when the test acts.
"""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from orchestrator.generation import generate
from orchestrator.server import connect
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.harness import (
    SlowBackend,
    cli_process,
    long_request,
    open_sessions,
    pipeline,
    slow_pipeline,
    status_of,
    wait_until,
)

Code = grpc.StatusCode
FREED_WITHIN = 1.0


@pytest.fixture(scope="module")
def slow(tiny_backends):
    with slow_pipeline(tiny_backends) as p:
        yield p


def started(p, stream):
    """The first chunk of a stream, once both services hold its session (the first token is the
    target's alone: the draft's open may still run)."""
    first = next(stream)
    assert first.token_ids and wait_until(lambda: p.open_sessions() == (1, 1), 30), p.open_sessions()
    return first


def test_cancel_after_first_token_frees_sessions(slow):
    stream = slow.orchestrator.GenerateStream(long_request(400))
    started(slow, stream)
    stream.cancel()
    assert slow.sessions_freed_within(FREED_WITHIN), slow.open_sessions()


def test_client_disconnect_frees_sessions(slow):
    channel = grpc.insecure_channel(slow.addresses["orchestrator"])
    stream = orchestrator_pb2_grpc.OrchestratorStub(channel).GenerateStream(long_request(400))
    started(slow, stream)
    channel.close()  # the connection goes away with the stream on it
    assert slow.sessions_freed_within(FREED_WITHIN), slow.open_sessions()


def test_cancelled_unary_generate_stops_and_frees_sessions(slow):
    call = slow.orchestrator.Generate.future(long_request(400))
    assert wait_until(lambda: slow.open_sessions() == (1, 1), 30)
    call.cancel()
    assert slow.sessions_freed_within(FREED_WITHIN), slow.open_sessions()
    assert call.cancelled()


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_deadline_bounds_the_generation_and_frees_sessions(slow, method):
    call = getattr(slow.orchestrator, method)
    if method == "GenerateStream":
        err = status_of(lambda: list(call(long_request(400), timeout=1.5)))
    else:
        err = status_of(lambda: call(long_request(400), timeout=1.5))
    assert err.code() == Code.DEADLINE_EXCEEDED
    assert slow.sessions_freed_within(FREED_WITHIN), slow.open_sessions()
    assert slow.orchestrator.Generate(long_request(4)).finish_reason == "length"  # still serving


class Recording:
    """A real stub whose calls also record the timeout they were given."""

    def __init__(self, stub):
        self.stub = stub
        self.timeouts: list[tuple[str, float | None]] = []

    def __getattr__(self, name):
        method = getattr(self.stub, name)

        def call(request, timeout=None):
            self.timeouts.append((name, timeout))
            return method(request, timeout=timeout)

        return call


@pytest.mark.usefixtures("draft_awaited")
def test_deadline_is_passed_on_to_the_model_services(slow):
    pair = connect(slow.addresses["draft"], slow.addresses["target"])
    draft, target = Recording(pair.draft), Recording(pair.target)
    pair = type(pair)(draft, target, pair.tokenizer, pair.max_context, pair.vocab_size, pair.eos_token_ids)
    list(generate(pair, long_request(12), timeout=30.0))
    calls = [(n, t) for n, t in draft.timeouts + target.timeouts if n != "CloseSession"]
    assert {n for n, _ in calls} >= {"OpenSession", "Propose", "Score"}
    assert all(t is not None and 0 < t <= 30.0 for _, t in calls), calls
    scores = [t for n, t in target.timeouts if n == "Score"]
    assert scores == sorted(scores, reverse=True)  # what is left of one deadline


@pytest.mark.slow
def test_killed_service_gives_unavailable_within_the_deadline(tiny_models, tiny_backends, tmp_path):
    """kill -9 of a standalone target service mid-stream, and it does not come back: the
    orchestrator waits for it (orchestrator.recovery) but answers UNAVAILABLE before the
    client's deadline, not DEADLINE_EXCEEDED and never a hang; the draft's session is freed."""
    args = ["target-service", "--model", tiny_models["target"], "--dtype", "float32", "--max-sessions", "4"]
    with cli_process(*args, ready_file=tmp_path / "target.ready", log=tmp_path / "target.log") as (proc, address):
        with pipeline(SlowBackend(tiny_backends["draft"], 0.01), None, target_address=address) as p:
            request = long_request(400, speculation=orchestrator_pb2.SpeculationParams(lookahead=1))
            stream = p.orchestrator.GenerateStream(request, timeout=6)
            started(p, stream)
            os.kill(proc.pid, signal.SIGKILL)
            err = status_of(lambda: list(stream))
            assert err.code() == Code.UNAVAILABLE, err.details()
            assert "target service" in err.details()
            assert wait_until(lambda: open_sessions(p.draft) == 0, FREED_WITHIN)
            err = status_of(lambda: p.orchestrator.Generate(long_request(8), timeout=3))
            assert err.code() == Code.UNAVAILABLE, err.details()
