"""Finishing a generation on another orchestrator when the one running it is lost.

A front door that spreads requests over several orchestrators (deploy.ray_serve: Ray Serve
replicas, each a pair) has streamed part of a request to its client when the orchestrator
running it dies. Another orchestrator finishes it, and the client cannot tell:
- the continuation runs the same request from its prompt plus the tokens already streamed
  (prefilled afresh), for the tokens still due. Greedy, it is token for token what the lost
  one would have produced; seeded under the invariant rule (the services key each position's
  noise by seed and position), the same sample; otherwise a sample of the same law;
- its text starts exactly where the client's stopped: it decodes the streamed tokens with its
  own (ContinuedTokenizer), so a character split by the break, text held back for a stop
  string, and a stop string that straddles the break come out as they would have;
- its last chunk's statistics are the whole request's: the counts of the part the client saw
  (its chunks' RoundCounts) are added, and the time is the door's (the lost part's service
  times are not known: draft_seconds and the like cover the continuation only).

Owns: Resume (what a door sends with a request to continue), continuation (the request and
the pair view that run the rest), stream (a request's chunks on a pair, in process), and
ResumingServicer (the door's Orchestrator API over
streams it opens, which resumes a lost stream on a fresh one). Knows nothing of Ray: what
opens a stream and which errors mean "lost" are given.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from orchestrator.generation import DEFAULT_MAX_NEW_TOKENS, ModelPair, RequestDefaults
from orchestrator.prompts import prompt_ids
from orchestrator.server import OrchestratorServicer
from specdec.errors import Cancelled, Unavailable
from specdec.limits import ResumePolicy
from specdec.serving.service import deadline_seconds
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger("specdec.continuation")


@dataclass(frozen=True)
class Resume:
    """What a client has been sent of a request: its token ids and its text's length."""

    token_ids: tuple[int, ...]
    text_length: int  # characters (code points)


def continuation(
    pair: ModelPair, request: orchestrator_pb2.GenerateRequest, resume: Resume
) -> tuple[ModelPair, orchestrator_pb2.GenerateRequest]:
    """The pair view and the request that generate the rest of `request` after `resume`."""
    rest = orchestrator_pb2.GenerateRequest()
    rest.CopyFrom(request)
    rest.token_ids.ids[:] = [*prompt_ids(pair, request), *resume.token_ids]  # the oneof: prompt, messages cleared
    rest.chat_template = False
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    # A streamed chunk never holds a request's last token (that comes with finish_reason), so at
    # least one is still due.
    rest.max_new_tokens = max_new - len(resume.token_ids)
    return replace(pair, tokenizer=ContinuedTokenizer(pair.tokenizer, resume)), rest


class ContinuedTokenizer:
    """The tokenizer as a continuation sees it: the text of its tokens is what follows the
    client's text in the text of the streamed tokens and them together."""

    def __init__(self, tokenizer, resume: Resume):
        self._tokenizer = tokenizer
        self._streamed = list(resume.token_ids)
        self._skip = resume.text_length

    def decode(self, token_ids, **kw) -> str:
        return self._tokenizer.decode(self._streamed + list(token_ids), **kw)[self._skip :]

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def stream(
    pair: ModelPair, request, resume: Resume | None, context, telemetry=None, defaults: RequestDefaults | None = None
) -> Iterator[orchestrator_pb2.GenerateChunk]:
    """The chunks of `request` on `pair`, or of its rest after `resume`: what an orchestrator
    that takes requests from a door runs (the servicer's GenerateStream, in process)."""
    if resume is not None:
        pair, request = continuation(pair, request, resume)
    return OrchestratorServicer(pair, telemetry, defaults).GenerateStream(request, context)


class CallContext:
    """The servicer context of a call that arrived by other means than gRPC (what the servicer
    asks of one): its deadline, and whether its caller still waits (cancel() says it does not)."""

    def __init__(self, timeout: float | None = None):
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return not self._cancelled and (self._deadline is None or time.monotonic() < self._deadline)


# (request, resume or None, seconds left or None) -> its chunks; closing it cancels the generation.
Opener = Callable[[orchestrator_pb2.GenerateRequest, Resume | None, float | None], Iterator]


@dataclass
class _Progress:
    """What a request's client has been sent, and the statistics of it."""

    token_ids: list[int] = field(default_factory=list)
    text_length: int = 0
    rounds: list[int] = field(default_factory=lambda: [0, 0, 0])  # rounds, draft tokens, accepted

    def add(self, chunk: orchestrator_pb2.GenerateChunk) -> None:
        self.token_ids += chunk.token_ids
        self.text_length += len(chunk.text)
        r = chunk.rounds
        self.rounds = [self.rounds[0] + r.rounds, self.rounds[1] + r.draft_tokens, self.rounds[2] + r.accepted_tokens]

    def resume(self) -> Resume | None:
        return Resume(tuple(self.token_ids), self.text_length) if self.token_ids or self.text_length else None


def whole_request_stats(
    last: orchestrator_pb2.GenerateStats, before: _Progress, wall: float
) -> orchestrator_pb2.GenerateStats:
    """A continuation's final statistics as the whole request's (the module docstring)."""
    stats = orchestrator_pb2.GenerateStats()
    stats.CopyFrom(last)
    stats.prompt_tokens -= len(before.token_ids)
    stats.generated_tokens += len(before.token_ids)
    stats.rounds += before.rounds[0]
    stats.draft_tokens += before.rounds[1]
    stats.accepted_tokens += before.rounds[2]
    stats.acceptance_rate = stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0
    stats.mean_accepted_length = stats.generated_tokens / stats.rounds if stats.rounds else 0.0
    stats.wall_seconds = wall
    stats.tokens_per_second = stats.generated_tokens / wall if wall > 0 else 0.0
    return stats


class ResumingServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """The Orchestrator API over streams from `open` (Generate assembles one). A stream that
    fails with an error `lost(error)` accepts is opened again, with what the client has been
    sent, for as long as the policy and the request's deadline allow; any other error is the
    request's. The seed is fixed here when the request leaves it unset, so a continuation
    draws from the same stream (the invariant rule then gives the same sample)."""

    def __init__(self, open: Opener, lost: Callable[[BaseException], bool], policy: ResumePolicy | None = None):
        self.open = open
        self.lost = lost
        self.policy = policy or ResumePolicy()
        self.resumed = 0  # streams continued after a loss, for status and tests

    def GenerateStream(self, request, context):
        yield from self._chunks(request, context)

    def Generate(self, request, context):
        reply = orchestrator_pb2.GenerateResponse()
        text = []
        for chunk in self._chunks(request, context):
            reply.token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            reply.finish_reason, last = chunk.finish_reason, chunk
        reply.text = "".join(text)
        reply.stats.CopyFrom(last.stats)
        return reply

    def _chunks(self, request, context) -> Iterator[orchestrator_pb2.GenerateChunk]:
        if not request.HasField("seed"):
            seeded = orchestrator_pb2.GenerateRequest()
            seeded.CopyFrom(request)
            seeded.seed = random.getrandbits(63)
            request = seeded
        timeout = deadline_seconds(context)
        start = time.monotonic()
        progress = _Progress()
        losses, first_loss = 0, 0.0
        backoff = self.policy.first_backoff
        while True:
            resume, before = progress.resume(), replace(progress, token_ids=list(progress.token_ids))
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            stream = self.open(request, resume, left)
            try:
                for chunk in stream:
                    if not context.is_active():
                        raise Cancelled("the client cancelled or its deadline passed")
                    if chunk.finish_reason and resume is not None:
                        chunk.stats.CopyFrom(whole_request_stats(chunk.stats, before, time.monotonic() - start))
                    progress.add(chunk)
                    yield chunk
                return
            except Exception as err:  # noqa: BLE001 - `lost` decides; anything else is raised again
                if not self.lost(err):
                    raise
                losses += 1
                now = time.monotonic()
                first_loss = first_loss or now
                expired = timeout is not None and now - start + backoff >= timeout
                if expired or now - first_loss + backoff > self.policy.wait_seconds:
                    raise Unavailable(
                        f"the generation was lost {losses} times (last: {type(err).__name__}: {err}); "
                        f"{len(progress.token_ids)} tokens were sent"
                    ) from err
                log.warning(
                    "a stream was lost after %d tokens (%s); continuing it on another orchestrator",
                    len(progress.token_ids), type(err).__name__,
                )  # fmt: skip
            finally:
                stream.close()
            self.resumed += 1
            time.sleep(backoff)
            backoff = min(2 * backoff, self.policy.max_backoff)
