"""A peer that hangs costs no more than one that dies: a model service stopped (SIGSTOP), its
packets dropped, its link slowed.

The stand-in models (specdec.runtime.standin: a sleep a step, no core) in processes, so that a service can
be stopped as a frozen host is: alive, its connections open, nothing answering.
- The draft stopped mid-generation: the request in flight finishes with the target's text (its
  rounds go without the draft once keepalive or the draft's call budget gives up on it), a new
  request is served target-only at once, and once the draft is woken a request speculates again.
- The target stopped: a request with a 5 s deadline fails by its deadline, one without fails
  UNAVAILABLE within the stated bound (keepalive's 5 s plus RecoveryConfig.hang_seconds), a new one
  at once; once woken, requests succeed again.
- The draft's packets dropped (nftables, the draft on a second host in a network namespace), and
  its link slowed to 200 ms and 2 s a message (bench.relay in this process): the same outcomes.
Bounds here are on state changes (a request that would otherwise wait for its 120 s deadline),
generous for a loaded 2-core machine, not speed measurements.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import grpc
import pytest

from bench.relay import DelayRelay
from deploy import hosting
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from deploy.local import LocalPipeline, PipelineConfig, RestartPolicy
from orchestrator.availability import CallBudget
from specdec.limits import RecoveryConfig
from specdec.runtime.standin import StandinBackend
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from tests import netns
from tests.harness import ROOT, wait_until

TARGET, DRAFT = "standin:3", "standin:1:0.9"
BOUND = 20.0  # seconds: the stated bounds (5 s keepalive, 6 s hang) with room for a loaded machine
TARGET_GIVES_UP = 30.0  # a stopped target's request without a deadline: keepalive + hang_seconds + slack
DEADLINE = 120.0  # what each request allows: a hung peer must not make it wait that long


def request(n: int, speculate: bool = True) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=n, speculation=pb.SpeculationParams(disabled=not speculate)
    )


def client(address: str):
    return orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))


def draft_fault(stub, start, end) -> None:
    """A generation in flight when `start()` cuts the draft off finishes with the target's text; a
    new request is served target-only within the bound; after `end()` a request speculates again."""
    long = request(2000)
    expected = list(stub.Generate(request(2000, speculate=False), timeout=DEADLINE).token_ids)
    in_flight = stub.Generate.future(long, timeout=DEADLINE)
    time.sleep(0.5)
    start()
    cut = time.monotonic()
    try:
        reply = in_flight.result()
        assert list(reply.token_ids) == expected and reply.stats.rounds_without_draft > 0
        fresh = time.monotonic()
        reply = stub.Generate(request(24), timeout=DEADLINE)
        assert list(reply.token_ids) == expected[:24] and time.monotonic() - fresh < BOUND
        assert time.monotonic() - cut < DEADLINE / 2  # not held until the deadline
    finally:
        end()

    def speculates() -> bool:
        return stub.Generate(request(24), timeout=DEADLINE).stats.accepted_tokens > 0

    assert wait_until(speculates, BOUND, step=0.2)


@pytest.mark.slow
def test_a_stopped_draft_then_a_stopped_target():
    # The supervisor's liveness probe off: these stops are the orchestrator's to survive, not to be ended by a kill.
    restart = RestartPolicy(unresponsive=0)
    cfg = PipelineConfig(target=ModelSpec(model=TARGET), draft=ModelSpec(model=DRAFT), lookahead=4, restart=restart)
    with LocalPipeline(cfg, log=lambda *_: None) as pipeline:
        stub = client(pipeline.address)
        draft = pipeline.procs["draft"].pid
        draft_fault(stub, lambda: os.kill(draft, signal.SIGSTOP), lambda: os.kill(draft, signal.SIGCONT))

        target = pipeline.procs["target"].pid
        long = request(4000)
        started = time.monotonic()
        with_deadline = stub.Generate.future(long, timeout=5.0)
        without = stub.Generate.future(long, timeout=DEADLINE)
        time.sleep(0.5)
        os.kill(target, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as err:
                with_deadline.result()
            assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            assert time.monotonic() - started < 5.0 + 2.0
            with pytest.raises(grpc.RpcError) as err:
                without.result()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "does not refuse connections" in err.value.details()
            assert time.monotonic() - stopped < TARGET_GIVES_UP
            asked = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:  # the target known lost: refused at once
                stub.Generate(request(8), timeout=DEADLINE)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - asked < BOUND
        finally:
            os.kill(target, signal.SIGCONT)

        def served() -> bool:
            try:
                return len(stub.Generate(request(8), timeout=DEADLINE).token_ids) == 8
            except grpc.RpcError:
                return False

        assert wait_until(served, BOUND, step=0.2)


@pytest.mark.slow
def test_a_slow_link_to_the_draft():
    """200 ms a message: the draft is slow, not lost (rounds wait for it, the text is the target's);
    2 s a message: keepalive's pings go unanswered within their timeout, the draft is left behind."""
    servers = []
    relay = None
    try:
        for role, model in (("draft", DRAFT), ("target", TARGET)):
            servers.append(hosting.serve_model(ModelServiceConfig(role), StandinBackend(model)))
        (_, draft_port), (_, target_port) = servers
        relay = DelayRelay(f"127.0.0.1:{draft_port}", rtt_ms=0).start()
        config = OrchestratorConfig(recovery=RecoveryConfig(), lookahead=4)
        orchestrator = hosting.start_orchestrator(relay.address, f"127.0.0.1:{target_port}", config)
        servers.append((orchestrator, orchestrator.port))
        stub = client(f"127.0.0.1:{orchestrator.port}")
        expected = list(stub.Generate(request(200, speculate=False), timeout=DEADLINE).token_ids)

        relay.one_way = 0.2  # 200 ms a message
        reply = stub.Generate(request(200), timeout=DEADLINE)
        assert list(reply.token_ids) == expected

        def slowed():
            relay.one_way = 2.0

        def restored():
            relay.one_way = 0.0

        draft_fault(stub, slowed, restored)
    finally:
        if relay is not None:
            relay.stop()
        for server, _ in reversed(servers):
            server.stop(None)


NFT = shutil.which("nft")
INSECURE = ["--allow-insecure"]  # plaintext between the test's own namespaces (tests/test_two_hosts.py has TLS)
WHY = netns.unavailable() or (None if NFT else "nftables' `nft` is not installed (apt-get install nftables)")


@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=f"dropping packets needs namespaces and nftables: {WHY}")
def test_the_draft_s_packets_dropped(tmp_path):
    """The draft on host b, the target and the orchestrator on host a; b drops every packet to the
    draft's port (its host up, its connections never reset), then lets them through again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_") or k == "SPECDEC_CACHE"}
    with netns.TwoHosts("h") as hosts:
        draft = hosts.serve("b", "draft-service", ["--model", DRAFT, *INSECURE], tmp_path, cwd=ROOT, env=env)
        target = hosts.serve("a", "target-service", ["--model", TARGET, *INSECURE], tmp_path, cwd=ROOT, env=env)
        address = hosts.serve(
            "a", "orchestrator", ["--draft-address", draft, "--target-address", target, "--lookahead", 4, *INSECURE],
            tmp_path, cwd=ROOT, env=env,
        )  # fmt: skip
        port = draft.rsplit(":", 1)[1]
        on_b = ["ip", "netns", "exec", hosts.names["b"], NFT]
        drop = [*on_b, f"add table inet sdhang; add chain inet sdhang input {{ type filter hook input priority 0 ; }}; "
                f"add rule inet sdhang input tcp dport {port} drop"]  # fmt: skip
        through = [*on_b, "delete table inet sdhang"]
        # The orchestrator listens on host a: the client runs there, and runs nft on host b.
        script = (
            "import subprocess, sys\n"
            "from tests.test_hung_peers import client, draft_fault\n"
            f"draft_fault(client(sys.argv[1]), lambda: subprocess.run({drop!r}, check=True), "
            f"lambda: subprocess.run({through!r}, check=True))\n"
            "print('ok')\n"
        )
        out = hosts.run("a", [sys.executable, "-c", script, address], cwd=ROOT, env=env)
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_a_call_budget_follows_the_calls_it_has_seen():
    budget = CallBudget(floor=2.0, ceiling=30.0, times=8.0)
    assert budget.seconds() == 30.0  # nothing seen yet: the ceiling
    budget.record(0.01)
    assert budget.seconds() == 2.0  # the floor
    budget.record(1.0)
    assert budget.seconds() == 8.0  # eight times the longest
    for _ in range(200):
        budget.record(0.01)
    assert budget.seconds() == 2.0  # a slow call decays away
    budget.record(10.0)
    assert budget.seconds() == 30.0  # never past the ceiling
