"""A soak: 1000 requests through the load test machinery (bench.loadtest.run) against the
three services as processes with tiny models; afterwards no session is left and no service's
resident memory grew past a bound over its level after a warm-up."""

from __future__ import annotations

import itertools

import grpc
import pytest

from bench import loadtest
from bench.chaos import open_sessions, service_rss
from deploy.local import LocalPipeline, PipelineConfig
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from tests.harness import wait_until

pytestmark = pytest.mark.slow

WARMUP = 100
REQUESTS = 1000
GROWTH_BOUND_MB = 50.0  # per service, over its resident memory after the warm-up


def requests() -> list[orchestrator_pb2.GenerateRequest]:
    """Short generations of different prompts and lengths, greedy and seeded sampling."""
    out = []
    for i, prompt in enumerate(["hello", "the rain in spain", "write a list", "why?", "1, 2, 3,"]):
        for sampled in (False, True):
            r = orchestrator_pb2.GenerateRequest(prompt=prompt, chat_template=True, max_new_tokens=6 + 2 * i)
            if sampled:
                r.sampling.temperature, r.seed = 0.9, 1 + i
            out.append(r)
    return out


def test_1000_requests_leave_no_session_and_no_memory_growth(tiny_models):
    config = PipelineConfig(
        target=ModelSpec(tiny_models["target"], "cpu", "float32"),
        draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
        start_timeout=120,
    )
    with LocalPipeline(config, log=lambda msg: None) as pipeline:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
        pool, turn = requests(), itertools.count()

        def call(timeout: float) -> int:
            return len(stub.Generate(pool[next(turn) % len(pool)], timeout=min(timeout, 60)).token_ids)

        warmup = loadtest.run(call, loadtest.LoadTestConfig(WARMUP, concurrency=8, time_limit=300))
        assert warmup.ok, warmup.text()
        before = service_rss(pipeline)
        report = loadtest.run(call, loadtest.LoadTestConfig(REQUESTS, concurrency=8, time_limit=600))
        assert report.ok and report.completed == REQUESTS, report.text()
        assert wait_until(lambda: open_sessions(pipeline) == {"draft": 0, "target": 0}, 2)
        after = service_rss(pipeline)
        print(report.text())
        print("resident MB after the warm-up -> after:", {n: f"{before[n]:.1f} -> {after[n]:.1f}" for n in after})
        grown = {n: after[n] - before[n] for n in after if after[n] - before[n] >= GROWTH_BOUND_MB}
        assert not grown, f"resident memory grew by more than {GROWTH_BOUND_MB} MB: {grown}"
        assert pipeline.failure is None and not pipeline.restarts
