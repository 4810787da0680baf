"""Stand-in models (specdec.runtime.standin): the name `standin:MS[:AGREE]` and its errors; two stand-ins
started as services by deploy.hosting (as `specdec ray up` and `serve` start any model) form a
pair whose greedy output follows the target's law token by token, every draft accepted when the
draft is the target's law, some refused (and the output unchanged) when it agrees less; their steps
take no core, so the orchestrator prices them as devices of their own."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from deploy import hosting
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec.runtime.standin import StandinBackend, StandinSpec
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec

PROMPT = [5, 12, 30, 18]


def test_a_standin_name_gives_its_forward_time_and_agreement():
    assert StandinSpec.parse("standin:40") == StandinSpec(0.04, 1.0)
    assert StandinSpec.parse("standin:2.5:0.8") == StandinSpec(0.0025, 0.8)
    for bad in ("standin:", "standin:x", "standin:1:2", "standin:1:0.5:3", "standin:-1", "llama"):
        with pytest.raises(ValueError, match=r"standin:MS\[:AGREE\]"):
            StandinSpec.parse(bad)


@contextlib.contextmanager
def standin_pair(draft: str, target: str = "standin:0"):
    """The two stand-ins as services and an orchestrator, on loopback; its stub."""
    servers = []
    try:
        addresses = {}
        for role, model in (("draft", draft), ("target", target)):
            server, port = hosting.start_model_service(ModelServiceConfig(role, ModelSpec(model)))
            servers.append(server)
            addresses[role] = f"127.0.0.1:{port}"
        # no pricing run at start: the tests count their own requests' rounds
        config = OrchestratorConfig(calibration_tokens=0)
        orchestrator = hosting.start_orchestrator(addresses["draft"], addresses["target"], config)
        servers.append(orchestrator.server)
        info = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(addresses["target"])).Describe(
            model_pb2.DescribeRequest()
        )
        assert (info.device, info.backend, info.eos_token_ids) == ("standin", "standin", [])
        yield orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orchestrator.port}"))
    finally:
        for server in servers:
            server.stop(None)


def test_standins_are_devices_of_their_own():
    """Stand-ins share no core (device "standin"): the pair's costs hold no shared cores, and
    adaptive lookahead's rounds stop overlapping past OVERLAP_LOAD generations, as a fixed k's."""
    from orchestrator.loop import OVERLAP_LOAD
    from orchestrator.server import connect

    servers = []
    try:
        addresses = {}
        for role in ("draft", "target"):
            server, port = hosting.start_model_service(ModelServiceConfig(role, ModelSpec("standin:0")))
            servers.append(server)
            addresses[role] = f"127.0.0.1:{port}"
        costs = connect(addresses["draft"], addresses["target"]).costs
        assert costs.sharing is None and costs.overlap_load == OVERLAP_LOAD
    finally:
        for server in servers:
            server.stop(None)


def law(n: int) -> list[int]:
    """The target stand-in's greedy continuation of PROMPT, from its law."""
    target, tokens = StandinBackend("standin:0"), list(PROMPT)
    for _ in range(n):
        tokens.append(target._next(tokens[-1], len(tokens) - 1))
    return tokens[len(PROMPT) :]


@pytest.mark.parametrize("agreement", [1.0, 0.5])
def test_two_standins_are_a_pair_with_the_target_laws_greedy_output(agreement):
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
        max_new_tokens=40,
        speculation=orchestrator_pb2.SpeculationParams(lookahead=4),
    )
    with standin_pair(f"standin:0:{agreement}") as stub:
        reply = stub.Generate(request, timeout=60)
    assert list(reply.token_ids) == law(40) and reply.finish_reason == "length"
    if agreement == 1.0:
        assert reply.stats.acceptance_rate == 1.0
    else:
        assert 0 < reply.stats.acceptance_rate < 1.0
