"""What the reliability tests share: the three services on loopback in this process, a
slowed backend, and polling helpers.

SlowBackend is the real tiny model with a sleep before each forward pass: it stands in for
a model large enough that a generation is still running when a test cancels, drains or
kills it. Nothing else is replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from deploy import hosting
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec.limits import AdmissionLimits, SessionLimits
from specdec.serving import security
from specdec.serving.service import CHANNEL_OPTIONS
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# Greedy decoding of the tiny target from this prompt meets no EOS for ~490 tokens.
NO_EOS_PROMPT = [1, 10, 7, 14, 14, 17, 39]


class SlowBackend:
    """A backend that sleeps `delay` seconds before each forward pass."""

    def __init__(self, backend, delay: float):
        self._backend = backend
        self.delay = delay

    def forward(self, cache, token_ids, n_logits):
        time.sleep(self.delay)
        return self._backend.forward(cache, token_ids, n_logits)

    def forward_batch(self, items, **trees):
        time.sleep(self.delay)  # one batched forward of several sessions costs one pass
        return self._backend.forward_batch(items, **trees)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def greedy(backend, prompt: list[int], max_new_tokens: int) -> list[int]:
    """A tiny HF backend's own greedy continuation of `prompt`, in process, EOS ignored: what a
    pipeline over it must produce."""
    import torch

    with torch.inference_mode():
        out = backend.model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def long_request(max_new_tokens: int, **kw) -> orchestrator_pb2.GenerateRequest:
    """A greedy request that runs to max_new_tokens (finish_reason "length")."""
    ids = orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT)
    return orchestrator_pb2.GenerateRequest(token_ids=ids, max_new_tokens=max_new_tokens, **kw)


def status_of(call) -> grpc.RpcError:
    """The error a call fails with (the test fails if it succeeds)."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def open_sessions(stub) -> int:
    return stub.Describe(model_pb2.DescribeRequest(), timeout=10).open_sessions


def wait_until(condition, within: float, step: float = 0.02) -> bool:
    """Poll `condition` until it holds or `within` seconds pass: a bound on a state change."""
    end = time.monotonic() + within
    while True:
        if condition():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(step)


@dataclass
class Pipeline:
    """Draft, target and orchestrator servers on loopback, with a stub for each."""

    orchestrator: orchestrator_pb2_grpc.OrchestratorStub
    draft: model_pb2_grpc.DraftServiceStub
    target: model_pb2_grpc.TargetServiceStub
    servers: dict
    addresses: dict

    def open_sessions(self) -> tuple[int, int]:
        return open_sessions(self.draft), open_sessions(self.target)

    def sessions_freed_within(self, seconds: float) -> bool:
        return wait_until(lambda: self.open_sessions() == (0, 0), seconds)


def service_channel(address: str, token: str | None = None) -> grpc.Channel:
    """A channel to a model service on loopback; `token`: the services' own (a LocalPipeline's
    service_token: its services refuse any other caller)."""
    return security.channel(address, security.ClientSecurity(token=token), CHANNEL_OPTIONS)


def model_stubs(draft_address: str, target_address: str, token: str | None = None):
    draft = model_pb2_grpc.DraftServiceStub(service_channel(draft_address, token))
    target = model_pb2_grpc.TargetServiceStub(service_channel(target_address, token))
    return draft, target


@contextlib.contextmanager
def pipeline(
    draft_backend,
    target_backend,
    limits=None,
    admission=None,
    target_address=None,
    lookahead=4,
    calibration_tokens=0,
    drafter=None,
    **settings,
):
    """The three services in this process (or the target at `target_address` instead);
    stopped however the test ends. `lookahead`: the orchestrator's default, fixed so that two
    requests run alike and their rounds compare (None: measured, the server's own default).
    `calibration_tokens`: the orchestrator's pricing run at start (0: none, a test's own
    requests are the pair's first rounds); `drafter`: the draft service's (None: the model's);
    `settings`: OrchestratorConfig's others."""
    servers, kept = {}, None
    limits = limits or SessionLimits()
    try:
        draft = ModelServiceConfig("draft", limits=limits)
        servers["draft"], draft_port = hosting.serve_model(draft, draft_backend, drafter=drafter)
        if target_address is None:
            target = ModelServiceConfig("target", limits=limits)
            servers["target"], target_port = hosting.serve_model(target, target_backend)
            target_address = f"127.0.0.1:{target_port}"
        addresses = {"draft": f"127.0.0.1:{draft_port}", "target": target_address}
        admission = admission or AdmissionLimits()
        config = OrchestratorConfig(admission, lookahead=lookahead, calibration_tokens=calibration_tokens, **settings)
        orchestrator = hosting.start_orchestrator(addresses["draft"], addresses["target"], config)
        kept = orchestrator.prices
        servers["orchestrator"] = orchestrator.server
        addresses["orchestrator"] = f"127.0.0.1:{orchestrator.port}"
        orchestrator = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(addresses["orchestrator"]))
        yield Pipeline(orchestrator, *model_stubs(addresses["draft"], addresses["target"]), servers, addresses)
    finally:
        if kept is not None:
            kept.stop()
        for server in servers.values():
            server.stop(None)


def slow_pipeline(tiny_backends, delay: float = 0.01, **kw):
    """pipeline() over the tiny models slowed to `delay` seconds a forward pass."""
    return pipeline(SlowBackend(tiny_backends["draft"], delay), SlowBackend(tiny_backends["target"], delay), **kw)


@contextlib.contextmanager
def cli_process(*args: str, ready_file: Path, log: Path, blocked_signals=()):
    """`python -m cli ARGS --ready-file F` as a child process; yields (proc, address).
    It starts with `blocked_signals` blocked, as under a parent that blocks them (a mask is
    inherited through exec; a launcher sets it, since preexec_fn is unsafe in a threaded
    parent). Killed at the end if it is still running."""
    cmd = [sys.executable, "-m", "cli", *args, "--port", "0", "--ready-file", str(ready_file)]
    if blocked_signals:
        block = f"import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {sorted(map(int, blocked_signals))})"
        cmd = [sys.executable, "-c", f"{block}; os.execv(sys.executable, sys.argv[1:])", *cmd]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        started = wait_until(lambda: ready_file.exists() or proc.poll() is not None, 180, step=0.1)
        assert started and proc.poll() is None, f"{args[0]} did not start:\n{log.read_text()}"
        yield proc, json.loads(ready_file.read_text())["address"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def run_clients(address: str, per_client: list[list[orchestrator_pb2.GenerateRequest]]) -> list[list[tuple]]:
    """Each client on its own channel, its requests one after another, all clients at once."""

    def client(requests):
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
        return [tuple(stub.Generate(r, timeout=600).token_ids) for r in requests]

    with ThreadPoolExecutor(len(per_client)) as pool:
        return list(pool.map(client, per_client))


def run_sequentially(address: str, per_client) -> list[list[tuple]]:
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
    return [[tuple(stub.Generate(r, timeout=600).token_ids) for r in requests] for requests in per_client]


def hold_port(port: int) -> socket.socket:
    """Keep a stopped service's loopback port from every other socket until it starts again there
    (close the returned socket first). Bound, not listening: a connection is refused, as with nothing
    there, but no other test's server bound to port 0 is handed it meanwhile (without a hold, bind(0)
    gave a just-freed port back 4 times in 20,000 here), which would answer in the stopped one's place."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the stopped server's TIME_WAITs
    held.bind(("127.0.0.1", port))
    return held


class ServiceProcess:
    """`specdec {role}-service` as a child process (`extra`: more of its flags)."""

    def __init__(self, role, model, workdir, port=0, extra=()):
        self.ready = workdir / f"{role}.ready"
        self.ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "cli", f"{role}-service", "--port", str(port)]
        cmd += ["--model", model, "--dtype", "float32", "--ready-file", str(self.ready), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout=120) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            assert self.proc.poll() is None, f"service exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "service did not start"
            time.sleep(0.1)
        return json.loads(self.ready.read_text())["address"]

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
