"""The pair priced before its first request (orchestrator.calibration): an orchestrator that runs its
pricing generations at start gives the first request that names no lookahead the k a warm server
gives it, shows the price in Describe, and leaves no session open; one that does not runs
DEFAULT_LOOKAHEAD until requests have measured the pair. The target is the tiny model slowed
(harness.SlowBackend: a step of a model far larger than its draft), the draft the same weights
unslowed: every draft is accepted and cheap, so the price is the most drafts a round, and a
request of 48 tokens that ran k = 4 would not (its text the same)."""

from __future__ import annotations

import pytest

from orchestrator.calibration import calibrate
from orchestrator.generation import ModelPair
from specdec.runtime.graphs import hf_backend
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.validation import DEFAULT_LOOKAHEAD, MEASURED_LOOKAHEAD
from specdec.weights.models import ModelSpec
from tests.harness import SlowBackend, pipeline


@pytest.fixture(scope="module")
def backends(tiny_models):
    spec = ModelSpec(tiny_models["target"], "cpu", "float32")
    return hf_backend(spec), SlowBackend(hf_backend(spec), 0.02)


def generate(stub) -> orchestrator_pb2.GenerateResponse:
    request = orchestrator_pb2.GenerateRequest(prompt="priced before it arrives", max_new_tokens=48)
    return stub.Generate(request, timeout=120)


@pytest.mark.parametrize("calibration_tokens", [0, 60])
def test_the_first_request_runs_the_warm_servers_k_once_the_pair_is_priced_at_start(backends, calibration_tokens):
    # sequential rounds: at every k the verify outweighs the drafts (overlapped, the price levels off
    # where the draft's k + 1 steps outlast the verify, and of equal prices takes the smallest k)
    with pipeline(*backends, lookahead=None, calibration_tokens=calibration_tokens, overlap=False) as p:
        info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10)
        assert info.HasField("pricing") == bool(calibration_tokens)
        assert p.open_sessions() == (0, 0)  # the pricing generations closed theirs
        first, warm = generate(p.orchestrator), generate(p.orchestrator)
    assert warm.stats.lookahead == MEASURED_LOOKAHEAD  # every draft accepted, drafts cheap: the most
    assert first.token_ids == warm.token_ids  # greedy: the target's text whatever k
    if calibration_tokens:
        assert info.pricing.lookahead == first.stats.lookahead == warm.stats.lookahead
        assert info.pricing.acceptance > 0.9 and info.pricing.speedup > 1
    else:
        assert first.stats.lookahead == DEFAULT_LOOKAHEAD


def test_a_pair_without_a_draft_is_not_priced(tiny_backends):
    pair = ModelPair(draft=None, target=None, tokenizer=None, max_context=64, vocab_size=8, eos_token_ids=frozenset())
    assert calibrate(pair, 60) is None
