"""Graceful drain: on SIGTERM health turns NOT_SERVING, new work gets UNAVAILABLE, work in
flight finishes (bounded by the drain timeout), and the process exits 0.

The orchestrator runs as its own process (`specdec orchestrator`), signalled for real; the
model services run in this process over the tiny models slowed to ~10 ms a forward pass, so
the stream is still running when the signal arrives.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import model_pb2, orchestrator_pb2_grpc
from target_service.server import serve as serve_target
from tests.harness import (
    NO_EOS_PROMPT,
    cli_process,
    long_request,
    model_stubs,
    slow_pipeline,
    status_of,
    wait_until,
)

Code = grpc.StatusCode
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


@pytest.fixture(scope="module")
def slow(tiny_backends):
    with slow_pipeline(tiny_backends) as p:
        yield p


@pytest.mark.slow
def test_sigterm_drains_the_orchestrator(slow, tmp_path):
    """The process starts with SIGTERM blocked, as under a parent that blocks it (a CI runner
    did): the service unblocks it rather than never hearing it."""
    args = ["orchestrator", "--draft-address", slow.addresses["draft"], "--target-address", slow.addresses["target"]]
    log = tmp_path / "orchestrator.log"
    started = cli_process(
        *args, "--drain-timeout", "120", ready_file=tmp_path / "ready", log=log, blocked_signals={signal.SIGTERM}
    )
    with started as (proc, address):
        client = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
        stream = client.GenerateStream(long_request(120))
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health(address) == NOT_SERVING, 30), log.read_text()
        err = status_of(lambda: client.Generate(long_request(4), timeout=30))
        assert err.code() == Code.UNAVAILABLE and "draining" in err.details()
        assert proc.poll() is None  # still draining: the stream is in flight
        chunks += list(stream)
        assert sum(len(c.token_ids) for c in chunks) == 120 and chunks[-1].finish_reason == "length"
        assert proc.wait(timeout=60) == 0, log.read_text()
    assert slow.open_sessions() == (0, 0)
    assert "draining" in log.read_text()


def test_a_draining_model_service_serves_open_sessions_and_refuses_new_ones(tiny_backends):
    server, port = serve_target(tiny_backends["target"])
    address = f"127.0.0.1:{port}"
    _, target = model_stubs(address, address)
    try:
        target.OpenSession(model_pb2.OpenSessionRequest(session_id="live", prompt_token_ids=[3, 4, 5]))
        drained = []
        drain = threading.Thread(target=lambda: drained.append(server.drain(timeout=60)))
        drain.start()
        assert wait_until(lambda: health(address, "specdec.v1.TargetService") == NOT_SERVING, 30)
        err = status_of(
            lambda: target.OpenSession(model_pb2.OpenSessionRequest(session_id="new", prompt_token_ids=[3]))
        )
        assert err.code() == Code.UNAVAILABLE
        # The open session is served while the drain waits for it.
        ref = model_pb2.SessionRef(session_id="live", expected_length=3)
        assert len(target.Score(model_pb2.ScoreRequest(session=ref, draft_token_ids=[6])).argmax_token_ids) == 2
        assert drain.is_alive()
        target.CloseSession(model_pb2.CloseSessionRequest(session_id="live"))
        drain.join(timeout=30)
        assert drained == [True]
    finally:
        server.stop(None)


def test_drain_gives_up_after_its_timeout(tiny_backends):
    server, port = serve_target(tiny_backends["target"])
    try:
        _, target = model_stubs(f"127.0.0.1:{port}", f"127.0.0.1:{port}")
        target.OpenSession(model_pb2.OpenSessionRequest(session_id="abandoned", prompt_token_ids=[3]))
        assert server.drain(timeout=0.2) is False
    finally:
        server.stop(None)


def test_a_ready_service_freezes_what_its_start_up_allocated():
    """lifecycle.freeze_heap, which the command line's services and Ray's actors call once ready:
    what the process holds by then (torch, transformers, the model: ~400k objects) leaves the
    cyclic collector's walk, so a full collection walks only what serving allocated since (each
    had stopped a service 0.1-0.3 s). In a process of its own: it freezes the caller's heap."""
    code = (
        "import gc, torch, transformers\n"
        "from specdec.serving.lifecycle import freeze_heap\n"
        "before = len(gc.get_objects())\n"
        "freeze_heap()\n"
        "print(before, len(gc.get_objects()), gc.get_freeze_count())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, walked, frozen = map(int, done.stdout.split())
    assert walked < before / 20 and frozen > before / 2, (before, walked, frozen)


@pytest.mark.slow
def test_http_requests_past_the_drain_get_503_and_the_orchestrator_exits(slow, tmp_path):
    """SIGTERM with HTTP requests in flight past --drain-timeout: the front door was stopped before
    the gRPC server, waited on the requests riding on its calls, cut the stream without a word and
    the unary request with an empty reply, and the process outlived its stop (killed by `serve`).
    Now gRPC stops first: the unary request gets 503, the stream an error event, the process exits 0;
    both say that the drain ran out."""
    args = ["orchestrator", "--draft-address", slow.addresses["draft"], "--target-address", slow.addresses["target"]]
    log, ready = tmp_path / "orchestrator.log", tmp_path / "ready"
    with cli_process(*args, "--http-port", "0", "--drain-timeout", "1", ready_file=ready, log=log) as (proc, _):
        url = json.loads(ready.read_text())["http_url"]
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
            model = json.loads(reply.read())["data"][0]["id"]
        body = {"model": model, "prompt": NO_EOS_PROMPT, "max_tokens": 400}
        replies = {}

        def post(stream: bool) -> None:
            data = json.dumps({**body, "stream": stream}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as reply:
                    replies[stream] = (reply.status, reply.read().decode())
            except urllib.error.HTTPError as err:
                replies[stream] = (err.code, err.read().decode())

        clients = [threading.Thread(target=post, args=(stream,)) for stream in (False, True)]
        for client in clients:
            client.start()
        assert wait_until(lambda: slow.open_sessions()[1] == 2, 30)  # both generating
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        for client in clients:
            client.join(30)
    assert replies[False][0] == 503 and "service_unavailable" in replies[False][1], replies[False]
    assert replies[True][0] == 200 and '"error"' in replies[True][1].rsplit("data: ", 1)[-1], replies[True][1][-300:]
    for _, text in replies.values():  # said so, where gRPC's own words were "Cancelling all calls"
        assert "the orchestrator stopped with this request in flight (its drain ran out)" in text, text[-300:]
    assert wait_until(lambda: slow.open_sessions() == (0, 0), 30)
