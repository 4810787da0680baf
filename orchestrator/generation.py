"""Text around the loop: request validation, prompt -> token ids, token ids -> text,
stop strings, and per-request stats.

The tokenizer is fetched from the target service (GetTokenizer), so the orchestrator's
host needs no model files.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec import validation
from specdec.errors import Cancelled, FailedPrecondition, InvalidArgument, OutOfRange
from specdec.v1 import model_pb2, orchestrator_pb2

DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_LOOKAHEAD = 4
MAX_LOOKAHEAD = validation.MAX_LOOKAHEAD
CHAT_ROLES = ("system", "user", "assistant")


def load_tokenizer(files: model_pb2.GetTokenizerResponse):
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for f in files.files:
            (Path(tmp) / Path(f.name).name).write_bytes(f.content)
        return AutoTokenizer.from_pretrained(tmp)


@dataclass(frozen=True)
class ModelPair:
    """What the orchestrator knows of the two services after checking them at startup."""

    draft: object  # DraftService stub
    target: object  # TargetService stub
    tokenizer: object
    max_context: int
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    stats: orchestrator_pb2.GenerateStats | None = None


def prompt_ids(pair: ModelPair, request: orchestrator_pb2.GenerateRequest) -> list[int]:
    tok = pair.tokenizer
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids must not be empty")
        validation.token_ids(ids, pair.vocab_size, "token_ids")
    elif kind == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise InvalidArgument("messages must not be empty")
        roles = [m["role"] for m in messages if m["role"] not in CHAT_ROLES]
        if roles:
            raise InvalidArgument(f"messages: unknown role {roles[0]!r} (one of {', '.join(CHAT_ROLES)})")
        if not tok.chat_template:
            raise FailedPrecondition("messages: the target model has no chat template")
        ids = _chat_ids(tok, messages)
    elif kind == "prompt":
        if not request.prompt:
            raise InvalidArgument("prompt must not be empty")
        if request.chat_template and tok.chat_template:
            ids = _chat_ids(tok, [{"role": "user", "content": request.prompt}])
        else:
            ids = tok.encode(request.prompt, add_special_tokens=True)
    else:
        raise InvalidArgument("one of prompt, messages or token_ids must be set")
    if not ids:
        raise InvalidArgument("the prompt is empty")
    return ids


def _chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def loop_config(pair: ModelPair, request, prompt_len: int) -> LoopConfig:
    s = request.sampling
    validation.sampling(s, "sampling")
    # Unset fields take their documented defaults; an explicit value is checked, zero included.
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    validation.at_least_one(max_new, "max_new_tokens")
    spec = request.speculation
    lookahead = spec.lookahead if spec.HasField("lookahead") else DEFAULT_LOOKAHEAD
    validation.lookahead(lookahead, "speculation.lookahead")
    validation.token_ids(request.stop_token_ids, pair.vocab_size, "stop_token_ids")
    if "" in request.stop_strings:
        raise InvalidArgument("stop_strings must not hold an empty string")
    if prompt_len + max_new > pair.max_context:
        raise OutOfRange(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new} exceeds the model context of {pair.max_context}"
        )
    return LoopConfig(
        sampling=s,
        max_new_tokens=max_new,
        lookahead=lookahead,
        speculate=not spec.disabled,
        adaptive=spec.adaptive,
        seed=request.seed if request.HasField("seed") else random.getrandbits(63),
        stop_token_ids=pair.eos_token_ids | frozenset(request.stop_token_ids),
    )


def generate(
    pair: ModelPair, request, timeout=None, observe=None, active: Callable[[], bool] = lambda: True
) -> Iterator[Chunk]:
    """Run one request; yield a chunk per round with new tokens, the last one with stats.

    `observe(loop)`, if given, stands in for loop.rounds() (telemetry wraps the rounds with it).
    `active()` is asked after each round: once it is False (the client went away) the
    generation stops and its sessions are closed.
    """
    start = time.perf_counter()
    ids = prompt_ids(pair, request)
    config = loop_config(pair, request, len(ids))
    stop_strings = list(request.stop_strings)
    hold = max((len(s) for s in stop_strings), default=1) - 1  # chars that may start a stop
    loop = SpeculativeLoop(pair.draft, pair.target, ids, config, timeout=timeout)
    tok = pair.tokenizer
    emitted = 0  # characters of text already sent
    text = ""
    pending_ids: list[int] = []
    finish = ""
    rounds = loop.rounds() if observe is None else observe(loop)
    try:
        for step in rounds:
            if not active():
                raise Cancelled("the client cancelled or its deadline passed")
            pending_ids += step.token_ids
            finish = step.finish_reason
            text = tok.decode(loop.generated, skip_special_tokens=True)
            search_from = max(0, emitted - hold)
            cut = _find_stop(text, stop_strings, search_from)
            if cut is not None:
                # Keep tokens up to the one that completes the stop string, text before it.
                keep = _tokens_through_stop(tok, loop.generated, len(step.token_ids), stop_strings, search_from)
                pending_ids = pending_ids[: len(pending_ids) - (len(loop.generated) - keep)]
                del loop.generated[keep:]
                text, finish = text[:cut], "stop"
            if finish:
                break
            # Hold back an incomplete character and what may be the start of a stop string.
            ready = len(text) - hold if stop_strings else len(text)
            if text.endswith("\ufffd"):
                ready = min(ready, len(text.rstrip("\ufffd")))
            if ready > emitted and pending_ids:
                yield Chunk(pending_ids, text[emitted:ready])
                emitted, pending_ids = ready, []
    finally:
        rounds.close()  # closes the sessions even when the client went away
    wall = time.perf_counter() - start
    yield Chunk(pending_ids, text[emitted:], finish, _stats(loop, len(ids), wall, config.seed))


def _tokens_through_stop(tok, ids: list[int], last_round: int, stops, start: int) -> int:
    """Fewest tokens whose text holds a stop string (searched from `start`)."""
    for n in range(len(ids) - last_round + 1, len(ids)):
        if _find_stop(tok.decode(ids[:n], skip_special_tokens=True), stops, start) is not None:
            return n
    return len(ids)


def _find_stop(text: str, stop_strings: list[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


def _stats(loop: SpeculativeLoop, prompt_len: int, wall: float, seed: int):
    s = loop.stats
    return orchestrator_pb2.GenerateStats(
        rounds=s.rounds,
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens,
        acceptance_rate=s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0,
        mean_accepted_length=(s.accepted_tokens + s.rounds) / s.rounds if s.rounds else 0.0,
        tokens_per_second=len(loop.generated) / wall if wall > 0 else 0.0,
        wall_seconds=wall,
        prompt_tokens=prompt_len,
        generated_tokens=len(loop.generated),
        draft_seconds=s.draft_seconds,
        target_seconds=s.target_seconds,
        seed=seed,
        round_seconds=s.round_seconds,
        draft_compute_seconds=s.draft_compute_seconds,
        target_compute_seconds=s.target_compute_seconds,
        wire_bytes=s.wire_bytes,
    )
