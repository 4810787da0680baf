"""OpenAI's answer JSON out of the orchestrator's gRPC API, for its HTTP front door
(orchestrator.openai_api): GenerateResponse / GenerateChunk -> OpenAI's responses and SSE chunks
(a chat's message or tool call, a completion's text), their usage, logprobs and the `specdec`
extension. The requests' JSON: orchestrator.openai_json.
"""

from __future__ import annotations

import codecs
import math
import time
import uuid
from dataclasses import dataclass

from orchestrator import openai_tools
from specdec.v1 import orchestrator_pb2


def usage(stats: orchestrator_pb2.GenerateStats, *more: orchestrator_pb2.GenerateStats) -> dict:
    """OpenAI's usage of one generation, or of a request's choices (`more`: the others' stats, one prompt)."""
    n, m = stats.prompt_tokens, stats.generated_tokens + sum(s.generated_tokens for s in more)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def speculation_stats(stats: orchestrator_pb2.GenerateStats) -> dict:
    """The extension field `specdec` of a response (and of a stream's last chunk)."""
    return {
        "rounds": stats.rounds,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "tokens_per_second": stats.tokens_per_second,
        "wall_seconds": stats.wall_seconds,
        "seed": stats.seed,
    }


@dataclass(frozen=True)
class Completion:
    """What every response and chunk of one request shares."""

    endpoint: str
    model: str
    id: str
    created: int
    logprobs: bool = False  # the client asked for them
    tools: openai_tools.Tools | None = None  # the tools the answer may call (chat)

    @classmethod
    def start(cls, endpoint: str, model: str, logprobs: bool = False, tools=None) -> Completion:
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        return cls(endpoint, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), logprobs, tools)

    def _message(self, r: orchestrator_pb2.GenerateResponse) -> tuple[dict, str]:
        """A chat answer's message and finish_reason: a tool call where the text makes one; a forced
        call cut by max_tokens, the call as far as it went (finish_reason "length")."""
        if self.tools is not None and self.tools.forced and r.finish_reason == "length":
            return {"role": "assistant", "content": None, "tool_calls": [self.tools.cut_call(r.text)]}, "length"
        call = self.tools.call(r.text) if self.tools is not None and r.finish_reason == "stop" else None
        if call is None:
            return {"role": "assistant", "content": r.text}, r.finish_reason
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"

    def _logprobs(self, entries, offset: int = 0, end: int | None = None) -> dict | None:
        """A choice's `logprobs` in the endpoint's shape (None unless asked for); `offset`: where the
        tokens' text starts in the completion (completions' text_offset); `end`: where a stop string
        cut the text, past which the tokens that made it are left out (the text leaves them out)."""
        if not self.logprobs:
            return None
        offsets = text_offsets(entries, offset)
        if end is not None:
            offsets = [at for at in offsets if at < end]
            entries = entries[: len(offsets)]
        if self.endpoint == "chat":
            return {"content": [_token_logprob(e, top=True) for e in entries], "refusal": None}
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{t.token: _finite(t.logprob) for t in e.top if t.logprob > -math.inf} for e in entries],
            "text_offset": offsets,
        }

    def _object(self, kind: str, choices: list, **extra) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def response(self, r: orchestrator_pb2.GenerateResponse, *more: orchestrator_pb2.GenerateResponse) -> dict:
        """The answer to a request: its generation, or its choices' (`more`: choices 1..n-1); usage
        counts the prompt once and every choice's tokens, `specdec` is the first choice's."""
        choices = []
        for index, each in enumerate((r, *more)):
            finish = each.finish_reason
            if self.endpoint == "chat":
                message, finish = self._message(each)
                choice = {"message": message}
            else:
                choice = {"text": each.text}
            logprobs = self._logprobs(each.logprobs, end=len(each.text) if each.finish_reason == "stop" else None)
            choices.append({"index": index, **choice, "logprobs": logprobs, "finish_reason": finish})
        kind = "chat.completion" if self.endpoint == "chat" else "text_completion"
        spent = usage(r.stats, *(m.stats for m in more))
        return self._object(kind, choices, usage=spent, specdec=speculation_stats(r.stats))

    def chunk(
        self,
        c: orchestrator_pb2.GenerateChunk,
        first: bool,
        include_usage: bool,
        offset: int = 0,
        index: int = 0,
        held: list | tuple = (),
    ) -> tuple[dict, list]:
        """A stream's chunk, and the tokens whose logprobs wait for the next one. `offset`: where its
        text starts in the completion; `held`: the earlier chunks' tokens whose text this one carries.
        A chunk's tokens may make text it holds back (part of a character, what may start a stop
        string): their logprobs go with the chunk that carries their text, or, past a stop string,
        with none."""
        entries, held = [*held, *c.logprobs], []
        if self.logprobs and c.finish_reason in ("", "stop"):
            starts = text_offsets(entries, offset)
            shown = sum(1 for at in starts if at < offset + len(c.text))
            entries, held = entries[:shown], entries[shown:] if not c.finish_reason else []
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": c.text} if first else {"content": c.text}
            choice, kind = {"delta": delta}, "chat.completion.chunk"
        else:
            choice, kind = {"text": c.text}, "text_completion"
        logprobs = self._logprobs(entries, offset)
        choice = {"index": index, **choice, "logprobs": logprobs, "finish_reason": c.finish_reason or None}
        r = c.rounds
        extension = {
            "spans": [[s.length, s.drafted] for s in c.spans],
            "tokens": len(c.token_ids),
            "round_counts": {"rounds": r.rounds, "draft_tokens": r.draft_tokens, "accepted_tokens": r.accepted_tokens},
        }
        if c.finish_reason:
            extension.update(speculation_stats(c.stats))
        extra = {"usage": None} if include_usage else {}
        return self._object(kind, [choice], specdec=extension, **extra), held

    def whole_chunks(self, answers: list[orchestrator_pb2.GenerateResponse], include_usage: bool) -> list[dict]:
        """Whole answers as a stream's chunks (tools: a call is known once its text is whole): each
        choice's message in one chunk (tool_calls whole), then its finish_reason, then the usage."""
        kind, extra = "chat.completion.chunk", {"usage": None} if include_usage else {}
        out = []
        for index, answer in enumerate(answers):
            message, finish = self._message(answer)
            if "tool_calls" in message:
                message["tool_calls"] = [{"index": 0, **call} for call in message["tool_calls"]]
            delta = {
                "index": index,
                "delta": message,
                "logprobs": self._logprobs(answer.logprobs),
                "finish_reason": None,
            }
            out.append(self._object(kind, [delta], **extra))
            done = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
            out.append(self._object(kind, [done], specdec=speculation_stats(answer.stats), **extra))
        if include_usage:
            out.append(self.usage_chunk(*(a.stats for a in answers)))
        return out

    def usage_chunk(self, stats: orchestrator_pb2.GenerateStats, *more: orchestrator_pb2.GenerateStats) -> dict:
        kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return self._object(kind, [], usage=usage(stats, *more))


def text_offsets(entries, offset: int = 0) -> list[int]:
    """Where each token's text starts in the completion (`offset`: where the first one's does): the
    characters its predecessors' bytes make. A token that holds part of a character starts at that
    character (each token's text decoded alone, a U+FFFD a part, drifted past the text)."""
    decoder, out = codecs.getincrementaldecoder("utf-8")("replace"), []
    for e in entries:
        out.append(offset)
        offset += len(decoder.decode(e.token_bytes))
    return out


LOWEST_LOGPROB = -9999.0  # what OpenAI reports for a token with no probability (JSON has no -inf)


def _finite(logprob: float) -> float:
    return logprob if logprob > -math.inf else LOWEST_LOGPROB


def _token_logprob(entry: orchestrator_pb2.TokenLogprob, top: bool = False) -> dict:
    """A token's entry of chat's logprobs.content (with its top_logprobs)."""
    out = {"token": entry.token, "logprob": _finite(entry.logprob), "bytes": list(entry.token_bytes)}
    if top:
        out["top_logprobs"] = [_token_logprob(t) for t in entry.top if t.logprob > -math.inf]
    return out
