"""A supervised local stack (deploy.local): a killed model service comes back on its port, a
killed orchestrator on its gRPC and HTTP ports, a restart that cannot bind is retried after a
backoff, too many restarts in a minute end the pipeline, and `specdec serve` ends with exit code 1
and a clear message when a child exits cleanly. Real processes with tiny random models, real
SIGKILLs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from deploy import liveness
from deploy.local import LocalPipeline, PipelineConfig, RestartPolicy
from specdec.v1 import model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from tests.harness import cli_process, open_sessions, service_channel, wait_until

pytestmark = pytest.mark.slow  # processes started, killed and signalled

REQUEST = orchestrator_pb2.GenerateRequest(prompt="hello", max_new_tokens=16)


def children(pid: int) -> dict[str, int]:
    """The child processes of `pid` that run a specdec command: command -> pid."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if ppid == pid and argv[1:3] == [b"-m", b"cli"]:
            found[argv[3].decode()] = int(stat.parent.name)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def generate(address: str) -> list[int]:
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
    return list(stub.Generate(REQUEST, timeout=120).token_ids)


def test_serve_restarts_a_killed_service_on_its_ports_and_exits_1_when_one_stops(tiny_models, tmp_path):
    models = ["--target-model", tiny_models["target"], "--draft-model", tiny_models["draft"]]
    models += ["--target-dtype", "float32", "--draft-dtype", "float32", "--max-sessions", "7", "--http-port", "0"]
    log = tmp_path / "serve.log"
    with cli_process("serve", *models, ready_file=tmp_path / "ready", log=log) as (serve, address):
        services = {}
        try:
            services = children(serve.pid)
            assert set(services) == {"draft-service", "target-service", "orchestrator"}
            argv = Path(f"/proc/{services['target-service']}/cmdline").read_bytes().split(b"\0")
            assert argv[argv.index(b"--max-sessions") + 1] == b"7"  # the limit flags reach the children
            before = generate(address)
            target = json.loads((tmp_path / "ready").read_text())["services"]["target"]

            os.kill(services["target-service"], signal.SIGKILL)
            assert wait_until(lambda: f"the target service is back on {target}" in log.read_text(), 120, step=0.2)
            assert f"was killed by SIGKILL; restarting it on {target}" in log.read_text()
            assert generate(address) == before  # the orchestrator found the target at the same address
            services = children(serve.pid)

            # The orchestrator: back on its gRPC and HTTP ports (a crash of the front door cost the
            # requests in flight, not the models loaded behind it).
            http = json.loads((tmp_path / "ready").read_text())["http_url"]
            os.kill(services["orchestrator"], signal.SIGKILL)
            assert wait_until(lambda: f"the orchestrator service is back on {address}" in log.read_text(), 120, 0.2)
            assert generate(address) == before
            assert http_get(f"{http}/health")["services"]["orchestrator"] == "SERVING"
            services = children(serve.pid)

            os.kill(services["orchestrator"], signal.SIGTERM)  # stopped on purpose: drains, exits 0
            assert serve.wait(120) == 1
            message = f"the orchestrator service (pid {services['orchestrator']}) exited with code 0"
            assert f"specdec: error: {message}" in log.read_text()
            assert not alive(services["draft-service"]) and not alive(services["target-service"])  # none orphaned
        finally:
            for pid in services.values():
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def http_get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def bound(sock: socket.socket, address: tuple[str, int]) -> bool:
    try:
        sock.bind(address)
    except OSError:
        return False
    return True


def tiny_config(tiny_models, **kw) -> PipelineConfig:
    return PipelineConfig(
        target=ModelSpec(tiny_models["target"], "cpu", "float32"),
        draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
        start_timeout=120,
        **kw,
    )


def test_a_restart_that_cannot_bind_is_retried_and_too_many_restarts_end_the_pipeline(tiny_models):
    config = tiny_config(tiny_models, restart=RestartPolicy(first_backoff=0.2, max_per_minute=2))
    lines: list[str] = []
    with LocalPipeline(config, log=lines.append) as pipeline:
        before = generate(pipeline.address)
        address = pipeline.addresses["target"]
        host, port = address.rsplit(":", 1)
        first = pipeline.serving_pid("target", 10)
        with socket.socket() as squatter:  # holds the port (listening, no SO_REUSEPORT) while the restart binds
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            os.kill(first, signal.SIGKILL)
            assert wait_until(lambda: bound(squatter, (host, int(port))), 10)  # once the kill has closed its socket
            squatter.listen()
            assert wait_until(lambda: any("restarting the target service failed" in x for x in lines), 120, 0.1)
        second = pipeline.serving_pid("target", 120, exclude={first})
        assert pipeline.addresses["target"] == address and pipeline.restarts["target"] == 1
        assert generate(pipeline.address) == before
        assert open_sessions(model_pb2_grpc.TargetServiceStub(service_channel(address, pipeline.service_token))) == 0

        os.kill(second, signal.SIGKILL)  # a third attempt within the minute: past the cap
        assert wait_until(lambda: pipeline.failure is not None, 30, 0.1)
        assert pipeline.failure == (
            f"the target service (pid {second}) was killed by SIGKILL; giving up after 2 restart attempts within 60 s"
        )


def test_a_service_that_answers_no_health_check_is_killed_and_restarted(tiny_models):
    """A hung host (SIGSTOP: alive, its port open, nothing answering) is not an exit: the prober
    kills what answers no health check for `unresponsive` seconds, and the monitor restarts it. The
    restarted one is probed afresh: through the dead one's channel, in gRPC's reconnect backoff, its
    probes failed at once for seconds and it was killed again (under load: restarts 2 for one hang)."""
    config = tiny_config(tiny_models, restart=RestartPolicy(unresponsive=3.0), calibration_tokens=0)
    lines: list[str] = []
    with LocalPipeline(config, log=lines.append) as pipeline:
        before = generate(pipeline.address)
        for name in ("target", "orchestrator"):
            frozen = pipeline.serving_pid(name, 10)
            os.kill(frozen, signal.SIGSTOP)
            try:
                pipeline.serving_pid(name, 120, exclude={frozen})
            finally:
                if alive(frozen):
                    os.kill(frozen, signal.SIGCONT)
            assert not alive(frozen) and pipeline.restarts[name] == 1
            assert f"specdec: the {name} service (pid {frozen}) answered no health check for 3 s; killing it" in lines
            assert generate(pipeline.address) == before
        restarts = [pipeline.restarts[name] for name in ("draft", "target", "orchestrator")]
        assert restarts == [0, 1, 1]  # none restarted twice: a restarted child answers its probes
    # the logs of a pipeline whose services were restarted are kept, and it says where
    # (the reason names the first trouble: the hang's kill here, or a child that ended badly at the stop)
    kept = [line for line in lines if line.startswith(f"specdec: the services' logs are kept in {pipeline.workdir} (")]
    assert len(kept) == 1, lines[-3:]
    assert (pipeline.workdir / "target.log").exists()
    shutil.rmtree(pipeline.workdir)


def test_a_crash_keeps_the_logs_when_the_pipeline_stops_before_its_restart(tiny_models):
    """A child that crashed is why its logs matter, whether its restart came up before the stop or
    not (one still starting was stopped, its folder removed and the crash's log with it)."""
    lines: list[str] = []
    pipeline = LocalPipeline(tiny_config(tiny_models), log=lines.append).start()
    pid = pipeline.serving_pid("draft", 10)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: any("restarting it" in line for line in lines), 30, 0.05)
    pipeline.stop()  # the restarted draft is still starting: it takes its SIGTERM there
    why = f"the draft service (pid {pid}) was killed by SIGKILL"
    assert lines[-1] == f"specdec: the services' logs are kept in {pipeline.workdir} ({why})"
    assert (pipeline.workdir / "draft.log").exists()
    shutil.rmtree(pipeline.workdir)


def test_a_stopped_child_drains_when_the_pipeline_stops(tiny_models):
    """A child stopped (SIGSTOP) when the pipeline stops takes its SIGTERM and drains (exit 0); it
    was killed once the drain timeout and 10 s had passed."""
    pipeline = LocalPipeline(tiny_config(tiny_models), log=lambda msg: None).start()
    procs = dict(pipeline.procs)
    os.kill(procs["draft"].pid, signal.SIGSTOP)
    pipeline.stop()
    assert {name: proc.returncode for name, proc in procs.items()} == {"draft": 0, "target": 0, "orchestrator": 0}
    assert not pipeline.workdir.exists()  # every child ended cleanly: its temporary folder went with them


def test_a_clean_exit_is_not_restarted(tiny_models):
    """A service stopped on purpose (SIGTERM: it drains and exits 0) stays stopped."""
    with LocalPipeline(tiny_config(tiny_models), log=lambda msg: None) as pipeline:
        pid = pipeline.serving_pid("draft", 10)
        os.kill(pid, signal.SIGTERM)
        assert wait_until(lambda: pipeline.failure is not None, 60, 0.1)
        assert pipeline.failure.startswith(f"the draft service (pid {pid}) exited with code 0; the pipeline cannot")
        assert pipeline.restarts["draft"] == 0 and pipeline.procs["draft"].poll() == 0
    assert (pipeline.workdir / "draft.log").exists()  # the pipeline failed: its logs are kept
    shutil.rmtree(pipeline.workdir)


def test_a_command_stopped_by_sigterm_stops_the_pipeline_it_started(tmp_path):
    """`timeout`, `kill` or a cancelled CI job send SIGTERM to the command alone: a bench's three
    services were left running (models loaded, ports bound). Now it unwinds as Ctrl-C does."""
    cmd = [sys.executable, "-m", "cli", "bench", "serving", "--clients", "1", "--methods", "off"]
    bench = subprocess.Popen(cmd + ["--duration", "120", "--out", str(tmp_path / "out")], stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: len(children(bench.pid)) == 3 or bench.poll() is not None, 120, 0.1)
        started = children(bench.pid)
        assert set(started) == {"draft-service", "target-service", "orchestrator"}, bench.stderr.read()
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        assert not [name for name, pid in started.items() if alive(pid)]
    finally:
        bench.kill()
        bench.wait()


def test_silence_counts_from_a_process_first_unanswered_probe_until_it_answers():
    """deploy.liveness.Silence, which both supervisors read: a key is silent past the limit only
    while no probe of it has been answered since; another key (a restarted pid) counts afresh."""
    silence = liveness.Silence(10.0)
    assert not silence.heard(1, False, 100.0)  # the first unanswered probe starts the count
    assert not silence.heard(1, False, 109.0)
    assert not silence.heard(2, False, 109.0)  # its own count
    assert silence.heard(1, False, 110.0)
    assert not silence.heard(1, True, 111.0)  # answered: the count starts again
    assert not silence.heard(1, False, 115.0) and silence.heard(1, False, 125.0)
    silence.forget(1)  # killed: its successor's silence is its own
    assert not silence.heard(1, False, 126.0)
    assert liveness.period(3.0) == 1.0 and liveness.period(30.0) == liveness.PROBE_SECONDS


def test_ctrl_c_on_a_streamed_generate_stops_its_pipeline_at_once(tmp_path):
    """Ctrl-C, as a terminal sends it (SIGINT to the foreground process group), on a local
    `generate --stream`: the three children got it too and drained at once, while the stream's
    call, never cancelled, kept the orchestrator generating until its drain timed out; the
    services went away under it and it was killed 30 s later ("did not stop within 30 s"). Now the
    children sit in sessions of their own, the command cancels its call and stops them in turn."""
    standins = ["--target-model", "standin:5", "--draft-model", "standin:0.5:0.8", "--max-tokens", "3000"]
    log = tmp_path / "generate.log"
    cmd = [sys.executable, "-m", "cli", "generate", "hi", *standins, "--stream"]
    with open(log, "w") as out:  # its own group, SIGINT at its default (a test runner may ignore it)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **_default_sigint())
    try:
        streaming = lambda: len(log.read_text().partition("services ready")[2]) > 200  # noqa: E731 - text came
        assert wait_until(streaming, 180, 0.1), log.read_text()
        started = children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        # a generation still running holds the orchestrator's drain for --drain-timeout (20 s): the
        # stop comes well before it only where the call was cancelled
        assert proc.wait(15) == 130, log.read_text()[-500:]
        assert "did not stop" not in log.read_text() and "kept in" not in log.read_text(), log.read_text()[-500:]
        assert not [name for name, pid in started.items() if alive(pid)]
    finally:
        proc.kill()
        proc.wait()


def _default_sigint() -> dict:
    """Popen's keywords for a child whose SIGINT is at its default, whatever this process's is."""

    def reset() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return {"preexec_fn": reset}
