"""A lost draft costs speed, never availability; a lost target never hangs a client.

Real gRPC servers on loopback with the tiny models (slowed a little, so that a generation is still
running when a service goes), the orchestrator and its HTTP front door as `specdec orchestrator`
builds them: a draft stopped mid-generation leaves the generation on target-only rounds (the
target's own greedy text), new requests served target-only, `/health` and Describe "degraded";
the draft back on its address is found by the probe and a later request speculates again; a draft
that hangs past its budget is left behind the same way; a draft that refuses a generation (its
sessions full) leaves that generation target-only; a lost target fails a request within its
deadline and new requests at once. The same under `specdec serve`, whose supervisor restarts the
draft while requests go on without it, and with the real default pair in three processes. A service
process killed while no request runs is reported lost by Describe, /health and `specdec status`
within seconds, with no request sent (they confirm it answers: orchestrator.availability.confirm).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy import hosting
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from deploy.local import LocalPipeline, PipelineConfig
from specdec.limits import RecoveryConfig, SessionLimits
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from tests.harness import (
    ROOT,
    ServiceProcess,
    SlowBackend,
    hold_port,
    long_request,
    model_stubs,
    open_sessions,
    wait_until,
)
from tests.test_openai_api import http_json

pytestmark = pytest.mark.slow  # services lost and found again, processes

DESCRIBE = model_pb2.DescribeRequest()
STANDINS = {"target": "standin:1", "draft": "standin:0.2:0.8"}  # specdec.runtime.standin: no model to load
LOST_WITHIN = 10.0  # seconds for a killed service to be reported lost (~1 s: one status check; room for load)


class Stack:
    """Draft, target and orchestrator (with its HTTP port) in this process; either model service
    can be stopped and started again on its port."""

    def __init__(self, backends: dict, recovery: RecoveryConfig | None = None, draft_limits=None):
        self.backends, self.limits = backends, {"draft": draft_limits or SessionLimits(), "target": SessionLimits()}
        self.servers, self.ports, self.held = {}, {}, {}
        for role in ("draft", "target"):
            self.start(role)
        # no pricing run at start: the tests' requests are the pair's first rounds (a priced pair that
        # prices speculation out opens no draft session a test expects refused)
        config = OrchestratorConfig(recovery=recovery or RecoveryConfig(), http_port=0, calibration_tokens=0)
        self.orchestrator = hosting.start_orchestrator(self.address("draft"), self.address("target"), config)
        channel = grpc.insecure_channel(f"127.0.0.1:{self.orchestrator.port}")
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        self.draft, self.target = model_stubs(self.address("draft"), self.address("target"))

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.ports[role]}"

    def start(self, role: str) -> None:
        if role in self.held:
            self.held.pop(role).close()
        config = ModelServiceConfig(role, limits=self.limits[role])
        self.servers[role], self.ports[role] = hosting.serve_model(
            config, self.backends[role], port=self.ports.get(role, 0)
        )

    def stop(self, role: str) -> None:
        """Stopped, its port held until it starts again: nothing else answers there meanwhile."""
        self.servers.pop(role).stop(None).wait()
        self.held[role] = hold_port(self.ports[role])

    def status(self) -> str:
        return self.stub.Describe(DESCRIBE, timeout=5).status

    def health(self) -> tuple[int, dict]:
        return http_json(self.orchestrator.http.url + "/health")

    def close(self) -> None:
        self.orchestrator.stop(None)
        for server in self.servers.values():
            server.stop(None)
        for held in self.held.values():
            held.close()


@pytest.fixture
def slowed(tiny_backends):
    return {role: SlowBackend(tiny_backends[role], 0.02) for role in ("draft", "target")}


def target_alone(stack: Stack, request: orchestrator_pb2.GenerateRequest) -> list[int]:
    alone = orchestrator_pb2.GenerateRequest()
    alone.CopyFrom(request)
    alone.speculation.disabled = True
    return list(stack.stub.Generate(alone, timeout=120).token_ids)


def test_a_lost_draft_leaves_the_target_serving_and_is_found_again(slowed):
    stack = Stack(slowed)
    try:
        request = long_request(120)
        expected = target_alone(stack, request)
        assert stack.status() == "ok" and stack.health() == (
            200,
            {"status": "ok", "services": dict.fromkeys(("orchestrator", "draft", "target"), "SERVING")},
        )
        stream = stack.stub.GenerateStream(request, timeout=120)
        chunks = [next(stream), next(stream)]  # speculating
        stack.stop("draft")
        chunks += list(stream)
        stats = chunks[-1].stats
        assert [t for c in chunks for t in c.token_ids] == expected  # the target's greedy text, each token once
        assert stats.rounds_without_draft > 0 and stats.draft_tokens > 0
        assert stack.status() == "degraded: draft unavailable"
        code, health = stack.health()
        assert code == 200 and health["status"] == "degraded" and health["reason"] == "draft unavailable"
        assert health["services"] == {"orchestrator": "SERVING", "draft": "UNAVAILABLE", "target": "SERVING"}

        reply = stack.stub.Generate(long_request(40), timeout=30)  # a new request: served target-only at once
        assert reply.stats.draft_tokens == 0
        assert reply.stats.rounds_without_draft == reply.stats.rounds and list(reply.token_ids) == expected[:40]
        adaptive = long_request(40)  # a policy has no k to choose: several steps a Score (it ran a Score a token)
        adaptive.speculation.adaptive = True
        reply = stack.stub.Generate(adaptive, timeout=30)
        assert list(reply.token_ids) == expected[:40] and reply.stats.rounds < 40 / 2, reply.stats.rounds

        stack.start("draft")  # back on its address: the probe finds it, requests speculate again
        assert wait_until(lambda: stack.status() == "ok", 30)
        reply = stack.stub.Generate(long_request(40), timeout=30)
        assert reply.stats.accepted_tokens > 0 and reply.stats.rounds_without_draft == 0
        assert list(reply.token_ids) == expected[:40]
        info = stack.stub.Describe(DESCRIBE, timeout=5)
        assert info.draft.available and info.draft.losses >= 1 and info.target.losses == 0
        assert wait_until(lambda: (open_sessions(stack.draft), open_sessions(stack.target)) == (0, 0), 5)
    finally:
        stack.close()


def test_a_draft_past_its_budget_is_left_behind(slowed):
    stack = Stack(slowed, RecoveryConfig(draft_timeout=0.5))
    try:
        request = long_request(80)
        expected = target_alone(stack, request)
        stream = stack.stub.GenerateStream(request, timeout=120)
        chunks = [next(stream)]
        slowed["draft"].delay = 3.0  # a draft host that stops answering in time
        chunks += list(stream)
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[-1].stats.rounds_without_draft > 0
    finally:
        slowed["draft"].delay = 0.02
        stack.close()


def test_a_draft_that_refuses_a_generation_leaves_it_target_only(slowed):
    """The draft's sessions full: the second generation goes on without drafts, the pair stays up."""
    stack = Stack(slowed, draft_limits=SessionLimits(max_sessions=1))
    try:
        request = long_request(60)
        expected = target_alone(stack, request)
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda _: stack.stub.Generate(request, timeout=120), range(2)))
        assert all(list(r.token_ids) == expected for r in replies)
        assert sorted(r.stats.rounds_without_draft > 0 for r in replies) == [False, True]
        assert stack.status() == "ok"
    finally:
        stack.close()


def test_a_lost_target_fails_within_the_deadline_and_new_requests_at_once(slowed):
    stack = Stack(slowed)
    try:
        started = time.monotonic()
        stream = stack.stub.GenerateStream(long_request(400), timeout=5)
        next(stream)
        stack.stop("target")
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 10
        asked = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stack.stub.Generate(long_request(8), timeout=30)
        # Fast, not at the deadline (30 s): a loaded machine may take a few seconds, never the 30.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - asked < 10
        assert stack.status() == "unavailable: target unavailable"
        code, health = stack.health()
        assert code == 503 and health["reason"] == "target unavailable"
        assert health["services"]["target"] == "UNAVAILABLE"
        assert wait_until(lambda: open_sessions(stack.draft) == 0, 5)  # the draft's session was closed
    finally:
        stack.close()


def test_a_service_killed_while_idle_is_reported_lost_without_a_request(tmp_path):
    """The stand-in services in processes, SIGKILLed while nothing calls them: Describe, /health and
    `specdec status` say so within seconds (they answered "ok", 200, exit 0 until a request failed);
    a draft started again on its port is found again."""
    services = {role: ServiceProcess(role, model, tmp_path) for role, model in STANDINS.items()}
    orchestrator = None
    try:
        address = {role: service.wait_ready() for role, service in services.items()}
        config = OrchestratorConfig(http_port=0, calibration_tokens=0)  # no request of its own
        orchestrator = hosting.start_orchestrator(address["draft"], address["target"], config)
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orchestrator.port}"))

        def status() -> str:
            return stub.Describe(DESCRIBE, timeout=5).status

        def health() -> tuple[int, dict]:
            return http_json(orchestrator.http.url + "/health")

        assert status() == "ok" and health()[0] == 200
        services["draft"].kill()
        assert wait_until(lambda: status() == "degraded: draft unavailable", LOST_WITHIN, step=0.2)
        code, body = health()
        assert code == 200 and body["status"] == "degraded" and body["reason"] == "draft unavailable"
        assert body["services"] == {"orchestrator": "SERVING", "draft": "UNAVAILABLE", "target": "SERVING"}
        info = stub.Describe(DESCRIBE, timeout=5)
        assert not info.draft.available and info.draft.losses == 1 and address["draft"] in info.draft.reason
        assert info.target.available and info.running == 0

        port = address["draft"].rsplit(":", 1)[1]
        services["draft"] = ServiceProcess("draft", STANDINS["draft"], tmp_path, port=port)
        services["draft"].wait_ready()
        assert wait_until(lambda: status() == "ok", 30, step=0.2)  # the probe found it again, as after a request

        services["target"].kill()
        assert wait_until(lambda: status() == "unavailable: target unavailable", LOST_WITHIN, step=0.2)
        code, body = health()
        assert code == 503 and body == {
            "status": "unavailable",
            "services": {"orchestrator": "SERVING", "draft": "SERVING", "target": "UNAVAILABLE"},
            "reason": "target unavailable",
        }
        cli = subprocess.run(
            [sys.executable, "-m", "cli", "status", "--address", f"127.0.0.1:{orchestrator.port}"],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 1, cli.stdout + cli.stderr
        assert cli.stdout.startswith("unavailable: target unavailable")
        assert f"target {address['target']}  unavailable: " in cli.stdout, cli.stdout
        info = stub.Describe(DESCRIBE, timeout=5)
        assert info.target.losses == 1 and info.draft.available and info.running == 0
    finally:
        if orchestrator is not None:
            orchestrator.stop(None)
        for service in services.values():
            if service.proc.poll() is None:
                service.proc.terminate()
                service.proc.wait(timeout=30)


def test_serve_does_not_wait_for_a_restarting_draft(tiny_models):
    """Under `specdec serve` the supervisor restarts a killed draft (seconds: a process start);
    meanwhile requests are served target-only, and afterwards they speculate again."""
    config = PipelineConfig(
        target=ModelSpec(tiny_models["target"], "cpu", "float32"),
        draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
        start_timeout=180,
        calibration_tokens=0,  # its requests name their k
    )
    with LocalPipeline(config, log=lambda *_: None) as pipeline:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
        # a lookahead named: alone, a request that names none may run plain rounds (the start's timing)
        request = long_request(64, speculation=orchestrator_pb2.SpeculationParams(lookahead=4))
        before = stub.Generate(request, timeout=60)
        assert before.stats.accepted_tokens > 0
        killed = pipeline.serving_pid("draft", 10)
        draft = pipeline.procs["draft"]
        draft.send_signal(signal.SIGKILL)
        draft.wait(timeout=30)  # gone before the request (in CI one answered a request sent right after the kill)
        # Served while the draft is down: rounds without it (a request that waited for the
        # restarted draft would have none). No clock is asserted: a loaded machine moves it.
        during = stub.Generate(request, timeout=60)
        assert during.token_ids == before.token_ids and during.stats.rounds_without_draft > 0
        pipeline.serving_pid("draft", 120, exclude=(killed,))  # the supervisor brought it back
        describe = lambda: stub.Describe(DESCRIBE, timeout=5).status  # noqa: E731
        assert wait_until(lambda: describe() == "ok", 60)
        after = stub.Generate(request, timeout=60)
        assert after.token_ids == before.token_ids and after.stats.accepted_tokens > 0


@pytest.mark.real_model
def test_the_default_pair_by_hand_survives_a_killed_draft(tmp_path):
    """The three processes as the README's "Across two hosts" starts them (on loopback), the
    default pair: the draft killed with SIGKILL mid-generation and started again on its port."""

    def start(role: str, *args: str) -> tuple[subprocess.Popen, str]:
        ready = tmp_path / f"{role}.ready"
        ready.unlink(missing_ok=True)
        log = open(tmp_path / f"{role}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", role, "--ready-file", str(ready), *args], stdout=log, stderr=log, cwd=ROOT
        )
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 300, step=0.2), role
        assert proc.poll() is None, (tmp_path / f"{role}.log").read_text()
        return proc, json.loads(ready.read_text())["address"]

    procs = {}
    try:
        procs["target"], target = start("target-service", "--port", "0")
        procs["draft"], draft = start("draft-service", "--port", "0")
        procs["orchestrator"], address = start(
            "orchestrator",
            "--port",
            "0",
            "--draft-address",
            draft,
            "--target-address",
            target,
            "--calibration-tokens",
            "0",
        )
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
        request = orchestrator_pb2.GenerateRequest(
            prompt="Write a long story about a lighthouse keeper.",
            chat_template=True,
            max_new_tokens=96,
            # named: alone, a request that names no lookahead may run plain rounds (the start's timing)
            speculation=orchestrator_pb2.SpeculationParams(lookahead=8),
        )
        alone = orchestrator_pb2.GenerateRequest()
        alone.CopyFrom(request)
        alone.speculation.disabled = True
        expected = list(stub.Generate(alone, timeout=300).token_ids)
        stream = stub.GenerateStream(request, timeout=300)
        chunks = [next(stream)]
        procs["draft"].send_signal(signal.SIGKILL)  # mid-generation: the rest is served without it
        chunks += list(stream)
        # Served while the draft is down (it is started again only below): a round that waited for
        # it would hold the stream to its deadline. No clock is asserted: beside another test
        # worker the target alone ran 4x slower than it did a minute before.
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[-1].stats.rounds_without_draft > 0
        short = orchestrator_pb2.GenerateRequest()
        short.CopyFrom(request)
        short.max_new_tokens = 40
        stats = stub.Generate(short, timeout=120).stats  # a new request too, and it never waits on the draft
        assert stats.rounds_without_draft > 0 and stats.draft_seconds == 0
        procs["draft"], _ = start("draft-service", "--port", draft.rsplit(":", 1)[1])
        assert wait_until(lambda: stub.Describe(DESCRIBE, timeout=5).status == "ok", 60)
        assert stub.Generate(request, timeout=120).stats.accepted_tokens > 0
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
