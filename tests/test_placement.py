"""--cpus and --threads: a model service pins itself to its cores and sizes its thread pool
from them, and says so in Describe (the service's own report, read over gRPC)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

from specdec.runtime import placement
from specdec.runtime.placement import Cores, parse_cpus, split_threads
from specdec.runtime.startup import PROFILE_TOKENS
from specdec.serving.service import CHANNEL_OPTIONS
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from tests.harness import cli_process, long_request


def test_parse_cpus():
    assert parse_cpus("0") == (0,)
    assert parse_cpus("3,1") == (1, 3)
    assert parse_cpus("0-2,6") == (0, 1, 2, 6)
    for bad in ("", "a", "2-1", "-1", "1-"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)


@pytest.mark.slow
@pytest.mark.parametrize("role", ["draft", "target"])
def test_service_applies_its_cores_and_threads(tiny_models, tmp_path, role):
    core = max(os.sched_getaffinity(0))  # the last core this test may use
    args = [f"{role}-service", "--model", tiny_models[role], "--cpus", str(core), "--threads", "1"]
    with cli_process(*args, ready_file=tmp_path / "ready", log=tmp_path / "log") as (_, address):
        stub_class = model_pb2_grpc.DraftServiceStub if role == "draft" else model_pb2_grpc.TargetServiceStub
        info = stub_class(grpc.insecure_channel(address, CHANNEL_OPTIONS)).Describe(model_pb2.DescribeRequest())
    assert list(info.cpus) == [core] and info.threads == 1


@pytest.mark.slow
def test_default_uses_every_core_it_may(tiny_models, tmp_path):
    with cli_process(
        "target-service", "--model", tiny_models["target"], ready_file=tmp_path / "ready", log=tmp_path / "log"
    ) as (_, address):
        stub = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(address, CHANNEL_OPTIONS))
        info = stub.Describe(model_pb2.DescribeRequest())
    cores = sorted(os.sched_getaffinity(0))
    assert list(info.cpus) == cores and info.threads == len(cores)


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [(["--cpus", "x"], "--cpus"), (["--threads", "0"], "--threads")])
def test_bad_placement_is_one_clear_line(tiny_models, flags, message):
    cmd = [sys.executable, "-m", "cli", "target-service", "--model", tiny_models["target"], "--port", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("specdec: error:") and message in out.stderr


def test_split_threads():
    assert split_threads(1) == (1, 1)
    assert split_threads(2) == (1, 1)
    assert split_threads(4) == (1, 3)
    assert split_threads(8) == (2, 6)


class ThreadsSeen:
    """A backend stand-in for Cores.step: the thread counts it was set to, in order."""

    def __init__(self):
        self.set = []

    def set_threads(self, n):
        self.set.append(n)


def test_a_step_on_every_core_runs_beside_no_other(tmp_path):
    """The core lock: steps on a service's share of the cores run beside the other service's
    (they do here, or the check below proves nothing), a step on more cores beside none. Each
    Cores sets its backend's threads when they change, and only then."""
    lock = tmp_path / "cores.lock"
    spans: list[tuple[float, float, bool]] = []
    guard = threading.Lock()
    seen = {}

    def service(role: str, plan: list[int]):
        cores, backend = Cores(role, 2, shared=True, lock_path=lock, cores=2), ThreadsSeen()
        seen[role] = backend
        for threads in plan:
            with cores.step(threads, backend):
                start = time.perf_counter()
                time.sleep(0.01)
                with guard:
                    spans.append((start, time.perf_counter(), threads > cores.share))

    plans = {"draft": [1, 1, 2, 1, 2, 2, 1] * 4, "target": [1, 2, 1, 1, 2, 1, 2] * 4}
    workers = [threading.Thread(target=service, args=item) for item in plans.items()]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    def overlap(a, b):
        return a[0] < b[1] and b[0] < a[1]

    pairs = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :] if overlap(a, b)]
    assert pairs, "no two steps ran at once: the lock was not tested"
    assert all(not a[2] and not b[2] for a, b in pairs), "a step on every core ran beside another"
    for role, plan in plans.items():  # set at each change of threads (the first step's 1: from 2)
        changes = [t for i, t in enumerate(plan) if t != (plan[i - 1] if i else 2)]
        assert seen[role].set == changes


def test_a_service_stuck_holding_the_cores_costs_the_other_the_patience_once(tmp_path, monkeypatch):
    """The other service stopped inside a step on every core (SIGSTOP keeps its lock): this one
    steps beside it after LOCK_PATIENCE, then at once while it is stuck, and takes the lock again
    once it lets go."""
    monkeypatch.setattr(placement, "LOCK_PATIENCE", 0.3)
    lock = tmp_path / "cores.lock"
    stuck, woken = Cores("draft", 2, shared=True, lock_path=lock, cores=2), threading.Event()
    entered = threading.Event()

    def hold():
        with stuck.step(2, ThreadsSeen()):
            entered.set()
            woken.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(10)
    cores = Cores("target", 2, shared=True, lock_path=lock, cores=2)
    waits = []
    for _ in range(3):
        with cores.step(2, ThreadsSeen()) as waited:
            waits.append(waited)
    assert waits[0] >= 0.3 and max(waits[1:]) < 0.3  # the patience, once
    woken.set()
    holder.join()
    time.sleep(0.1)  # the abandoned wait gets the lock and lets it go
    with cores.step(2, ThreadsSeen()):  # the lock again: the other one's step now waits for this one
        other = threading.Thread(target=lambda: stuck.step(2, ThreadsSeen()).__enter__())
        t0 = time.perf_counter()
        other.start()
        other.join(0.1)
        assert other.is_alive()  # waiting for this step's lock
    other.join(10)
    assert not other.is_alive() and time.perf_counter() - t0 < 0.3 + 5


def test_start_ups_take_turns_to_time_their_forwards(tmp_path, monkeypatch):
    """Two services starting on one machine load at once, but neither times its forwards while the
    other loads or warms up, and one timing its own holds off a third's load; a start-up that never
    ends costs the other STARTUP_PATIENCE, then it times beside it. A service that owns its cores
    takes no turn."""
    paths = {"lock_path": tmp_path / "cores.lock", "startup_path": tmp_path / "startup.lock"}
    draft, target = (Cores(role, 2, shared=True, cores=2, **paths) for role in ("draft", "target"))
    draft.starting()
    target.starting()  # both load at once
    draft.started()
    timing, done = threading.Event(), threading.Event()

    def time_forwards():
        with draft.timing():
            timing.set()
            done.wait(10)

    timer = threading.Thread(target=time_forwards)
    timer.start()
    assert not timing.wait(0.3)  # the target still loads
    target.started()
    assert timing.wait(5)
    third = Cores("target", 2, shared=True, cores=2, **paths)
    loading = threading.Thread(target=third.starting)
    loading.start()
    loading.join(0.3)
    assert loading.is_alive()  # waits for the draft's timing
    done.set()
    timer.join(5)
    loading.join(5)
    assert not loading.is_alive()
    monkeypatch.setattr(placement, "STARTUP_PATIENCE", 0.2)
    t0 = time.perf_counter()
    with target.timing():  # the third never says it started
        assert time.perf_counter() - t0 >= 0.2
    alone = Cores("draft", 2, shared=False, **paths)
    t0 = time.perf_counter()
    alone.starting()
    with alone.timing():
        alone.started()
    assert time.perf_counter() - t0 < 0.1


def test_a_step_runs_with_the_fewest_threads_its_requests_allow():
    cores = Cores("target", 4, shared=False)
    assert cores.of([None, None]) == 4
    assert cores.of([None, 2, 3]) == 2
    assert cores.of([]) == 4
    assert cores.counts() == [4]  # it owns its cores: one count


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="sharing cores needs two")
def test_two_services_on_one_machine_share_its_cores(tiny_models, tmp_path):
    """Unpinned on one machine, each service reports its machine and times its forwards at its
    share of the cores and at every core; the orchestrator sees that they share the cores. A
    request's threads are those its forwards run with (more than the service has: its own), a
    request that names none gets every core; and a greedy generation, whichever placement each
    round takes, is the target's own greedy output."""
    from deploy import hosting
    from deploy.configs import OrchestratorConfig
    from orchestrator.server import connect

    n = len(os.sched_getaffinity(0))
    shares = dict(zip(("draft", "target"), split_threads(n), strict=True))
    with contextlib.ExitStack() as stack:
        addresses, infos = {}, {}
        for role in ("draft", "target"):
            args = [f"{role}-service", "--model", tiny_models[role]]
            args += ["--drafter", "model"] if role == "draft" else []  # its forwards, timed (not an index's)
            _, addresses[role] = stack.enter_context(
                cli_process(*args, ready_file=tmp_path / f"{role}.ready", log=tmp_path / f"{role}.log")
            )
            stub_class = model_pb2_grpc.DraftServiceStub if role == "draft" else model_pb2_grpc.TargetServiceStub
            stub = stub_class(grpc.insecure_channel(addresses[role], CHANNEL_OPTIONS))
            infos[role] = (stub, stub.Describe(model_pb2.DescribeRequest()))
        (draft, draft_info), (target, target_info) = infos["draft"], infos["target"]
        assert draft_info.machine and draft_info.machine == target_info.machine
        for role, (_, info) in infos.items():
            assert {c.threads for c in info.step_costs} == {shares[role], n}, role
        assert {c.tokens for c in target_info.step_costs} == set(PROFILE_TOKENS)
        costs = connect(addresses["draft"], addresses["target"]).costs
        sharing = costs.sharing
        assert sharing is not None and sharing.threads(True) == (shares["draft"], shares["target"])
        assert costs.overlap_load is None  # on shared cores the price chooses the kind of round at every load
        assert sharing.threads(False) == (n, n)

        greedy = model_pb2.SamplingParams()
        for stub in (draft, target):
            stub.OpenSession(model_pb2.OpenSessionRequest(session_id="s", prompt_token_ids=[1, 10, 7], threads=1))
        session = model_pb2.SessionRef(session_id="s", expected_length=3)
        for asked, ran in ((1, 1), (n + 5, n), (None, n)):
            threads = {} if asked is None else {"threads": asked}
            proposal = draft.Propose(model_pb2.ProposeRequest(session=session, k=2, sampling=greedy, **threads))
            assert proposal.threads == ran and proposal.steps == 2
            scores = target.Score(
                model_pb2.ScoreRequest(session=session, draft_token_ids=proposal.token_ids, sampling=greedy, **threads)
            )
            assert scores.threads == ran
        bad = model_pb2.ProposeRequest(session=session, k=1, sampling=greedy, threads=0)
        with pytest.raises(grpc.RpcError) as err:
            draft.Propose(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # no pricing run at start: an adaptive request's first rounds draft (priced, this random draft's do not pay)
        config = OrchestratorConfig(calibration_tokens=0)
        orchestrator = hosting.start_orchestrator(addresses["draft"], addresses["target"], config)
        stack.callback(orchestrator.stop, None)
        client = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orchestrator.port}"))

        def generate(**speculation):
            request = long_request(48, speculation=orchestrator_pb2.SpeculationParams(**speculation))
            return client.Generate(request, timeout=300)

        alone = generate(disabled=True)
        assert alone.stats.target_core_seconds == pytest.approx(n * alone.stats.target_forward_seconds)
        for speculation in ({"lookahead": 4}, {"lookahead": 4, "overlap": False}, {"lookahead": 6, "adaptive": True}):
            out = generate(**speculation)
            assert list(out.token_ids) == list(alone.token_ids), speculation
            s = out.stats
            assert s.draft_core_seconds >= s.draft_forward_seconds > 0 and s.target_core_seconds > 0, speculation
