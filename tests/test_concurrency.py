"""Concurrent clients: all requests complete, greedy outputs equal their sequential runs, and
no session is left open. 16 clients x 4 requests on the tiny models (services in this
process); 4 clients on the default pair are in test_real_model.py, on its pipeline."""

from __future__ import annotations

import pytest

from specdec.v1 import orchestrator_pb2
from tests.harness import pipeline, run_clients, run_sequentially

pytestmark = pytest.mark.slow


def test_16_clients_x_4_requests_on_tiny_models(tiny_backends):
    per_client = [
        [
            orchestrator_pb2.GenerateRequest(
                prompt=f"client {c} asks {r}",
                max_new_tokens=24,
                speculation=orchestrator_pb2.SpeculationParams(lookahead=1 + (c + r) % 4),
            )
            for r in range(4)
        ]
        for c in range(16)
    ]
    with pipeline(tiny_backends["draft"], tiny_backends["target"]) as p:
        address = p.addresses["orchestrator"]
        sequential = run_sequentially(address, per_client)
        concurrent = run_clients(address, per_client)
        assert concurrent == sequential
        lengths = [len(ids) for outputs in concurrent for ids in outputs]
        assert sum(n == 24 for n in lengths) > len(lengths) / 2, lengths  # most ran to max_new_tokens
        assert p.open_sessions() == (0, 0)
