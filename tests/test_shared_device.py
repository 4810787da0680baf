"""Two services on one accelerator: the orchestrator learns it from their Describe (device_id, a CUDA
device's UUID) and runs sequential rounds for requests that leave overlap unset, where overlapped
rounds' kernels would time-slice the device (docs/gpu.md: 0.78-0.87x on one H200). Real gRPC
services on loopback with tiny models; CUDA is not here, so the services' device identity is what
placement.device_id answers (patched: the one thing this test cannot have)."""

from __future__ import annotations

import grpc
import pytest

from draft_service.server import serve as serve_draft
from orchestrator.generation import RequestDefaults
from orchestrator.server import connect, shared_accelerator
from orchestrator.server import serve as serve_orchestrator
from specdec.runtime import placement
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from target_service.server import serve as serve_target


def info(device_id: str, machine: str = "m1") -> model_pb2.ModelInfo:
    return model_pb2.ModelInfo(device_id=device_id, machine=machine)


def test_one_accelerator_is_the_same_device_on_the_same_machine():
    assert shared_accelerator(info("GPU-a"), info("GPU-a"))
    assert not shared_accelerator(info("GPU-a"), info("GPU-b"))  # a GPU pair
    assert not shared_accelerator(info("GPU-a", "m1"), info("GPU-a", "m2"))
    assert not shared_accelerator(info(""), info(""))  # CPUs: their cores are shared_cores' question


def test_the_device_id_of_a_cpu_is_empty():
    assert placement.device_id("cpu") == ""


@pytest.fixture
def pipeline(tiny_backends):
    """Two real services, and start(defaults) -> (the orchestrator's stub, its pair) against them:
    the pair learns where they run at connect (their Describe)."""
    draft_server, draft_port = serve_draft(tiny_backends["draft"])
    target_server, target_port = serve_target(tiny_backends["target"])
    started = [draft_server, target_server]

    def start(defaults: RequestDefaults | None = None):
        pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
        server, port = serve_orchestrator(pair, defaults=defaults)
        started.append(server)
        return orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{port}")), pair

    yield start
    for server in started:
        server.stop(None)


def generate(stub, overlap: bool | None = None) -> orchestrator_pb2.GenerateStats:
    speculation = orchestrator_pb2.SpeculationParams(lookahead=4)
    if overlap is not None:
        speculation.overlap = overlap
    sampling = model_pb2.SamplingParams(temperature=1.0)
    request = orchestrator_pb2.GenerateRequest(
        prompt="hello world", max_new_tokens=48, seed=5, sampling=sampling, speculation=speculation
    )
    return stub.Generate(request, timeout=120).stats


def overlapped(stats: orchestrator_pb2.GenerateStats) -> bool:
    """Whether the rounds overlapped: the draft proposed past what was verified (continuations thrown
    away at a rejection); sequential rounds draft exactly what the target verifies."""
    assert stats.draft_tokens > 0 and stats.accepted_tokens < stats.draft_tokens  # rejections happened
    return stats.drafted_tokens > stats.draft_tokens


def test_services_on_one_gpu_run_sequential_rounds_unless_told(pipeline, monkeypatch):
    monkeypatch.setattr(placement, "device_id", lambda device: "GPU-0f2c")  # both say so (the module's doc)
    stub, pair = pipeline()
    assert pair.shared_device
    assert not overlapped(generate(stub))  # the request left overlap unset: sequential
    assert overlapped(generate(stub, overlap=True))  # a request's own choice stands
    stub, _ = pipeline(RequestDefaults(overlap=True))  # so does the server's flag (--overlap)
    assert overlapped(generate(stub))


def test_services_on_a_cpu_overlap_by_default(pipeline):
    stub, pair = pipeline()
    assert not pair.shared_device
    assert overlapped(generate(stub))
