"""Surviving the loss of a standalone service (no Ray): the orchestrator's connection drops,
the service comes back at the same address with empty caches, and the generation continues
with exactly the tokens of an uninterrupted one.

Services are real gRPC servers on loopback with tiny random models: a real process killed
with SIGKILL and started again on the same port, and (cheaper, for the many cases) an
in-process server stopped and replaced by a fresh one on the same port.
"""

from __future__ import annotations

import time

import grpc
import pytest

from draft_service.server import serve as serve_draft
from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.server import connect
from orchestrator.server import serve as serve_orchestrator
from specdec.decoding.sampling import SamplingParams
from specdec.errors import Unavailable
from specdec.limits import RecoveryConfig
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from target_service.server import serve as serve_target
from tests.harness import ServiceProcess, SlowBackend, hold_port, open_sessions

PROMPT = [1, 10, 7, 14, 14, 17, 39]
GREEDY = SamplingParams()
SAMPLING = SamplingParams(temperature=1.0, top_k=12)


def run(
    pair, sampling=GREEDY, n=40, kill_after=None, restart=lambda: None, timeout=None, overlap=False, rule="leviathan"
):
    """Generate n tokens; after round `kill_after`, call `restart` (between two rounds)."""
    config = LoopConfig(sampling=sampling, max_new_tokens=n, lookahead=3, seed=5, overlap=overlap, rule=rule)
    loop = SpeculativeLoop(pair.draft, pair.target, PROMPT, config, timeout=timeout, health=pair.health)
    for i, _ in enumerate(loop.rounds()):
        if i == kill_after:
            restart()
    return loop


class InProcess:
    """A model service in this process that can be 'restarted': a fresh server and engine on
    the same port, so every session is lost, as after a crash."""

    def __init__(self, serve, backend):
        self.serve, self.backend = serve, backend
        self.server, self.port = serve(backend, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.port}"
        self.held = None

    def stop(self):
        """Stopped, its port held: until it restarts, nothing answers there (no other test's server)."""
        if self.held is None:
            self.server.stop(None).wait()
            self.held = hold_port(self.port)

    def restart(self):
        self.stop()
        self.held.close()
        self.held = None
        self.server, _ = self.serve(self.backend, "127.0.0.1", self.port)

    def close(self):
        self.stop()
        self.held.close()


@pytest.fixture
def services(tiny_backends):
    yield from _services(tiny_backends["draft"], tiny_backends["target"])


@pytest.fixture
def slow_target_services(tiny_backends):
    """As `services`, the target's forwards 10 ms each: a generation lasts long enough (60 tokens,
    0.6 s and more) for a restarted draft's session to re-open whatever the machine's load (with
    the tiny target's 1-2 ms forwards, a loaded CI machine's had finished before it)."""
    yield from _services(tiny_backends["draft"], SlowBackend(tiny_backends["target"], 0.01))


def _services(draft, target):
    sides = {"draft": InProcess(serve_draft, draft), "target": InProcess(serve_target, target)}
    yield sides
    for side in sides.values():
        side.close()


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_restarted_target_gives_the_uninterrupted_output(services, sampling, overlap):
    """The round the target lost is re-run from the same committed state with the same draws."""
    pair = connect(services["draft"].address, services["target"].address)
    reference = run(pair, sampling, overlap=overlap)
    assert reference.stats.recoveries == 0
    assert not overlap or reference.stats.overlapped_rounds > 0
    for kill_after in (0, 4):
        loop = run(pair, sampling, kill_after=kill_after, restart=services["target"].restart, overlap=overlap)
        # A seeded sampling run equal to the uninterrupted one shows the round's draws were reused.
        assert loop.generated == reference.generated
        assert loop.stats.recoveries == 1


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize(
    "sampling, rule", [(GREEDY, "leviathan"), (SAMPLING, "invariant"), (SAMPLING, "leviathan")],
    ids=["greedy", "invariant", "leviathan"],
)  # fmt: skip
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_restarted_draft_costs_rounds_never_the_text(slow_target_services, sampling, rule, overlap):
    """A restarted draft lost every session: rounds go without drafts (exact: the target's own)
    until the session re-opens, then speculate again. Greedy and the invariant rule's seeded text are
    the target's own, unchanged; a Leviathan seed's rounds met other draws (another sample of the law)."""
    services = slow_target_services
    pair = connect(services["draft"].address, services["target"].address)
    reference = run(pair, sampling, overlap=overlap, rule=rule, n=60)
    for kill_after in (0, 4):
        loop = run(
            pair, sampling, kill_after=kill_after, restart=services["draft"].restart, overlap=overlap, rule=rule, n=60
        )
        assert len(loop.generated) == 60
        if rule == "invariant" or sampling.greedy:
            assert loop.generated == reference.generated
        assert loop.stats.draft_tokens > 0 and loop.stats.recoveries == 0  # the draft was never waited for
    assert pair.health[0].up
    assert services["draft"].backend is not None and open_sessions(pair.draft) == 0


def test_a_service_that_does_not_come_back_is_unavailable(services):
    pair = connect(services["draft"].address, services["target"].address, recovery=RecoveryConfig(wait_seconds=1.0))
    with pytest.raises(Unavailable) as err:
        run(pair, kill_after=2, restart=services["target"].stop)
    assert "target service" in err.value.message and services["target"].address in err.value.message
    assert "did not come back" in err.value.message
    draft_info = pair.draft.Describe(model_pb2.DescribeRequest())
    assert draft_info.open_sessions == 0  # the other side's session was closed, not leaked


def test_client_sees_unavailable_and_the_orchestrator_keeps_serving(services):
    pair = connect(services["draft"].address, services["target"].address, recovery=RecoveryConfig(wait_seconds=3.0))
    server, port = serve_orchestrator(pair)
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = orchestrator_pb2.GenerateRequest(prompt="hello", max_new_tokens=16)
        before = stub.Generate(request)
        services["target"].stop()
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "target service" in err.value.details()
        assert pair.health[1].wait(up=False, timeout=10)  # the loss is known: the target is down
        # A new request while the target is down is refused at once ("retry later"), never after a
        # wait for the target to come back ("did not come back within 3.0 s"). The 30 s deadline is
        # a hang guard only.
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "target service" in err.value.details()
        assert "retry later" in err.value.details() and "did not come back" not in err.value.details()
        services["target"].restart()
        assert pair.health[1].wait(up=True, timeout=10)  # the probe finds it back
        assert stub.Generate(request).token_ids == before.token_ids
        assert pair.draft.Describe(model_pb2.DescribeRequest()).open_sessions == 0
    finally:
        server.stop(None)


def test_reopen_replaces_a_session_the_service_still_holds(services):
    """Only the connection broke: the service kept the session, perhaps mid-request."""
    pair = connect(services["draft"].address, services["target"].address)
    target = pair.target
    target.OpenSession(model_pb2.OpenSessionRequest(session_id="kept", prompt_token_ids=[3, 4, 5, 6]))
    target.reopen("kept", [3, 4, 5, 8, 9])
    state = target.GetSession(model_pb2.GetSessionRequest(session_id="kept"))
    assert list(state.token_ids) == [3, 4, 5, 8, 9] and state.cached_length == 4
    target.CloseSession(model_pb2.CloseSessionRequest(session_id="kept"))


@pytest.mark.usefixtures("draft_always_awaited")
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_a_late_open_on_the_draft_costs_rounds_never_the_request(services, sampling):
    """An OpenSession sent on a link that was held reaches the draft after the generation's own:
    the draft answers ALREADY_EXISTS. That is the draft's session lost (a new one opens under an id
    of its own), never the request's error; the late session is closed, not leaked."""
    pair = connect(services["draft"].address, services["target"].address)
    reference = run(pair, sampling)
    config = LoopConfig(sampling=sampling, max_new_tokens=40, lookahead=3, seed=5)
    loop = SpeculativeLoop(pair.draft, pair.target, PROMPT, config, health=pair.health)
    pair.draft.OpenSession(model_pb2.OpenSessionRequest(session_id=loop.draft.session_id, prompt_token_ids=[3, 4]))
    for _ in loop.rounds():
        pass
    assert len(loop.generated) == 40 and loop.stats.draft_tokens > 0  # speculated again
    if sampling.greedy:
        assert loop.generated == reference.generated
    assert pair.health[0].up
    deadline = time.monotonic() + 10
    while open_sessions(pair.draft) and time.monotonic() < deadline:  # closed in the background
        time.sleep(0.05)
    assert open_sessions(pair.draft) == 0


def test_reopen_outlasts_a_late_open(services):
    """A re-open whose open meets a session a late open made (ALREADY_EXISTS) closes it and opens again."""
    pair = connect(services["draft"].address, services["target"].address)
    target, real = pair.target, pair.target._stub
    late = model_pb2.OpenSessionRequest(session_id="late", prompt_token_ids=[3, 4])

    class Late:  # the service's own stub, with an open on another connection landing just before ours
        def __getattr__(self, name):
            return getattr(real, name)

        def OpenSession(self, request, timeout=None):  # noqa: N802 - the stub's method
            if request.session_id == "late" and not getattr(self, "done", False):
                self.done = True
                real.OpenSession(late)
            return real.OpenSession(request, timeout=timeout)

    target._stub = Late()
    target.reopen("late", [3, 4, 5, 8])
    state = real.GetSession(model_pb2.GetSessionRequest(session_id="late"))
    assert list(state.token_ids) == [3, 4, 5, 8]
    real.CloseSession(model_pb2.CloseSessionRequest(session_id="late"))


@pytest.mark.slow
def test_killed_service_process_restarted_on_the_same_port(tiny_models, tiny_backends, tmp_path):
    draft = InProcess(serve_draft, tiny_backends["draft"])
    target = ServiceProcess("target", tiny_models["target"], tmp_path)
    try:
        address = target.wait_ready()
        pair = connect(draft.address, address)
        reference = run(pair)
        first_pid = target.proc.pid

        def kill_and_restart():
            nonlocal target
            target.kill()
            target = ServiceProcess("target", tiny_models["target"], tmp_path, port=address.rsplit(":", 1)[1])

        loop = run(pair, kill_after=3, restart=kill_and_restart)  # the restarted process is still starting
        assert loop.generated == reference.generated
        assert loop.stats.recoveries == 1 and pair.target.reopens == 1
        assert target.wait_ready() == address and target.proc.pid != first_pid
    finally:
        target.kill()
        draft.close()
