"""The orchestrator's defaults for what a request leaves unset (its --lookahead and --adaptive, beside
--overlap, --rule and --tree): a request's own choice stands, explicit false and zero included
(speculation.adaptive and speculation.lookahead are optional on the wire); the flags reach the
orchestrator through `serve`, `orchestrator` and `ray up`, and a bad one is refused before anything starts."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from cli import options
from cli.main import build_parser
from deploy.configs import OrchestratorConfig
from draft_service.server import serve as serve_draft
from orchestrator.generation import RequestDefaults, loop_config, request_defaults
from orchestrator.pair_costs import PairCosts
from orchestrator.server import connect
from orchestrator.server import serve as serve_orchestrator
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from target_service.server import serve as serve_target

PAIR = SimpleNamespace(
    vocab_size=100,
    max_context=512,
    draft=object(),
    eos_token_ids=frozenset(),
    shared_device=False,
    tree_verify=True,
    costs=PairCosts(),  # nothing measured: a measured default is DEFAULT_LOOKAHEAD
)


def config(defaults: RequestDefaults, **speculation):
    request = orchestrator_pb2.GenerateRequest(
        max_new_tokens=8, speculation=orchestrator_pb2.SpeculationParams(**speculation)
    )
    return loop_config(PAIR, request, 4, defaults)


def test_unset_fields_take_the_orchestrator_defaults_and_set_ones_stand():
    plain = config(RequestDefaults())
    assert (plain.lookahead, plain.adaptive, plain.measured) == (4, False, True)
    defaults = RequestDefaults(lookahead=16, adaptive=True)
    assert (config(defaults).lookahead, config(defaults).adaptive) == (16, True)
    chosen = config(defaults, lookahead=3, adaptive=False)  # explicit false: not the server's true
    assert (chosen.lookahead, chosen.adaptive) == (3, False)
    assert config(RequestDefaults(), adaptive=True).adaptive


def test_the_flags_reach_the_orchestrator():
    parse = build_parser().parse_args
    served = options.request_defaults(parse(["serve", "--lookahead", "16", "--adaptive"]))
    assert options.pipeline_config(parse(["serve"]), **served).lookahead == 16
    assert options.pipeline_config(parse(["serve"]), **served).adaptive
    args = parse(["orchestrator", "--target-address", "h:1", "--lookahead", "8"])
    settings = OrchestratorConfig(**options.request_defaults(args))
    assert request_defaults(settings) == RequestDefaults(lookahead=8, adaptive=False)
    assert options.request_defaults(parse(["ray", "up", "--adaptive"]))["adaptive"]
    generate = parse(["generate", "hi"])  # a client sends only what it is given
    assert generate.lookahead is None and generate.adaptive is None
    assert parse(["generate", "hi", "--no-adaptive"]).adaptive is False
    with pytest.raises(ValueError, match="--lookahead must be in 1..32"):  # before anything starts
        options.request_defaults(parse(["serve", "--lookahead", "40"]))


@pytest.mark.usefixtures("draft_awaited")
def test_a_served_default_lookahead_drafts_that_many(tiny_backends):
    draft_server, draft_port = serve_draft(tiny_backends["draft"])
    target_server, target_port = serve_target(tiny_backends["target"])
    pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
    server, port = serve_orchestrator(pair, defaults=RequestDefaults(lookahead=1, overlap=False))
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

        def stats(**speculation) -> orchestrator_pb2.GenerateStats:
            request = orchestrator_pb2.GenerateRequest(
                prompt="hello world",
                max_new_tokens=40,
                sampling=model_pb2.SamplingParams(),
                speculation=orchestrator_pb2.SpeculationParams(**speculation),
            )
            return stub.Generate(request, timeout=120).stats

        unset = stats()
        assert 0 < unset.draft_tokens <= unset.rounds  # one draft a round at most: the server's lookahead
        own = stats(lookahead=4)
        assert own.draft_tokens > own.rounds  # the request's own
    finally:
        for s in (server, draft_server, target_server):
            s.stop(None)
