"""Stateless checks of requests at the edge: each rejects with the status code the client
should see and a message that starts with the field's name.

This module owns the checks that need no session: ranges, counts, finiteness, the
vocabulary. Checks against a session's state are the engine's (unknown session, stale
length, room in the context, the KV budget). Servicers run these first, so a request is
refused in this order, and a refused request changes nothing:
INVALID_ARGUMENT (here), NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE, RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec.errors import InvalidArgument

MAX_LOOKAHEAD = 32  # draft tokens per round, at the orchestrator and the draft service
DEFAULT_LOOKAHEAD = 4  # draft tokens per round when a request names none


def sampling(msg, field: str = "sampling") -> None:
    """SamplingParams, the fields that are set: temperature finite and >= 0; top_p in (0, 1];
    top_k >= 1. Unset fields take their defaults (specdec.sampling.SamplingParams.from_proto)."""
    if msg.HasField("temperature") and not (math.isfinite(msg.temperature) and msg.temperature >= 0):
        raise InvalidArgument(f"{field}.temperature must be finite and >= 0, got {msg.temperature}")
    if msg.HasField("top_p") and not (math.isfinite(msg.top_p) and 0.0 < msg.top_p <= 1.0):
        raise InvalidArgument(f"{field}.top_p must be in (0, 1] (leave it unset for 1: off), got {msg.top_p}")
    if msg.HasField("top_k") and msg.top_k < 1:
        raise InvalidArgument(f"{field}.top_k must be >= 1 (leave it unset for off), got {msg.top_k}")


def token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{field}: token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")


def at_least_one(value: int, field: str) -> None:
    if value < 1:
        raise InvalidArgument(f"{field} must be >= 1, got {value}")


def lookahead(k: int, field: str) -> None:
    if not 1 <= k <= MAX_LOOKAHEAD:
        raise InvalidArgument(f"{field} must be in 1..{MAX_LOOKAHEAD}, got {k}")


def probabilities(values: Sequence[float], count: int, field: str) -> None:
    """`count` probabilities, each finite and in [0, 1]."""
    if len(values) != count:
        raise InvalidArgument(f"{field}: needs {count} entries, got {len(values)}")
    bad = [v for v in values if not (math.isfinite(v) and 0.0 <= v <= 1.0)]
    if bad:
        raise InvalidArgument(f"{field}: {bad[0]} is not a probability in [0, 1]")


def uniforms(values: Sequence[float], count: int, field: str) -> None:
    """`count` uniforms, each in [0, 1)."""
    if len(values) != count:
        raise InvalidArgument(f"{field}: needs {count} entries, got {len(values)}")
    bad = [v for v in values if not 0.0 <= v < 1.0]  # NaN fails too
    if bad:
        raise InvalidArgument(f"{field}: {bad[0]} is outside [0, 1)")


def threads(request) -> None:
    """A request's threads, where it names them: at least one."""
    if request.HasField("threads") and request.threads < 1:
        raise InvalidArgument(f"threads must be >= 1 when set, got {request.threads}")


def propose_request(request, vocab_size: int) -> None:
    """DraftService.Propose, before the session is touched."""
    lookahead(request.k, "k")
    threads(request)
    sampling(request.sampling)
    token_ids(request.append_tokens, vocab_size, "append_tokens")
    token_ids(request.assumed_tokens, vocab_size, "assumed_tokens")
    if request.sampling.temperature > 0:
        # The invariant rule draws nothing: its noise comes from noise_seed.
        uniforms(request.uniforms, 0 if request.HasField("noise_seed") else request.k, "uniforms")


def score_request(request, vocab_size: int) -> None:
    """TargetService.Score, before the session is touched."""
    sampling(request.sampling)
    threads(request)
    token_ids(request.append_tokens, vocab_size, "append_tokens")
    token_ids(request.draft_token_ids, vocab_size, "draft_token_ids")
    if request.sampling.temperature > 0:
        k = 0 if request.HasField("noise_seed") else len(request.draft_token_ids)  # invariant: ids only
        probabilities(request.draft_token_probs, k, "draft_token_probs")
        uniforms(request.accept_uniforms, k, "accept_uniforms")
