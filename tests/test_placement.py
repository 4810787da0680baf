"""--cpus and --threads: a model service pins itself to its cores and sizes its thread pool
from them, and says so in Describe (the service's own report, read over gRPC)."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from specdec.placement import parse_cpus
from specdec.service import CHANNEL_OPTIONS
from specdec.v1 import model_pb2, model_pb2_grpc
from tests.harness import cli_process


def test_parse_cpus():
    assert parse_cpus("0") == (0,)
    assert parse_cpus("3,1") == (1, 3)
    assert parse_cpus("0-2,6") == (0, 1, 2, 6)
    for bad in ("", "a", "2-1", "-1", "1-"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_service_applies_its_cores_and_threads(tiny_models, tmp_path, role):
    core = max(os.sched_getaffinity(0))  # the last core this test may use
    args = [f"{role}-service", "--model", tiny_models[role], "--cpus", str(core), "--threads", "1"]
    with cli_process(*args, ready_file=tmp_path / "ready", log=tmp_path / "log") as (_, address):
        stub_class = model_pb2_grpc.DraftServiceStub if role == "draft" else model_pb2_grpc.TargetServiceStub
        info = stub_class(grpc.insecure_channel(address, CHANNEL_OPTIONS)).Describe(model_pb2.DescribeRequest())
    assert list(info.cpus) == [core] and info.threads == 1


def test_default_uses_every_core_it_may(tiny_models, tmp_path):
    with cli_process(
        "target-service", "--model", tiny_models["target"], ready_file=tmp_path / "ready", log=tmp_path / "log"
    ) as (_, address):
        stub = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(address, CHANNEL_OPTIONS))
        info = stub.Describe(model_pb2.DescribeRequest())
    cores = sorted(os.sched_getaffinity(0))
    assert list(info.cpus) == cores and info.threads == len(cores)


@pytest.mark.parametrize("flags,message", [(["--cpus", "x"], "--cpus"), (["--threads", "0"], "--threads")])
def test_bad_placement_is_one_clear_line(tiny_models, flags, message):
    cmd = [sys.executable, "-m", "cli", "target-service", "--model", tiny_models["target"], "--port", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("specdec: error:") and message in out.stderr
