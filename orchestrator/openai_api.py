"""The orchestrator's OpenAI-compatible HTTP front door: POST /v1/chat/completions and
/v1/completions (JSON or server-sent events), GET /v1/models, GET /health, and the playground
page at / (orchestrator/static).

Owns: OpenAI request JSON -> GenerateRequest, GenerateResponse / GenerateChunk -> OpenAI JSON and
SSE chunks, gRPC status -> HTTP status and OpenAI's error shape (one table), the bearer-token
check and TLS of the HTTP port, and the uvicorn server in a thread (serve_http).

It generates nothing itself. Each request goes to the orchestrator's own gRPC API over loopback,
so admission (429), drain (503), auth, limits, validation and stop handling are the gRPC
server's: one loop, two front doors. A 429 says only that the server is full (OpenAI's clients
retry it). Structured output (response_format; vLLM's structured_outputs and guided_*) becomes
GenerateRequest.constraint, logprobs / top_logprobs GenerateRequest.logprobs. This module refuses
up front only what the gRPC API has no field for (n > 1, penalties, tools, ...), so that no
parameter is silently ignored; what OpenAI's API bounds tighter than the gRPC API (temperature
in [0, 2]); and a body over MAX_BODY_BYTES (413, counted while the body is read, before anything
reaches the gRPC hop). A request sets a
GenerateRequest field only when the client gave the parameter.

A client that goes away cancels its gRPC call, streamed or not, and the orchestrator closes the
sessions at its next round: an abandoned request costs at most one more round. Streams: one SSE
chunk per GenerateChunk (one per committed round), then `data: [DONE]`. Calls go over the plain
channel with the trace context injected by hand: the OpenTelemetry client interceptor wraps a
stream call in a generator that cannot be cancelled.
"""

from __future__ import annotations

import itertools
import json
import math
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

import orchestrator
from orchestrator.server import MAX_REQUEST_BYTES
from specdec import security
from specdec.telemetry import Telemetry, disabled
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.validation import MAX_LOGPROBS

STATIC = Path(__file__).parent / "static"
PAGE_FILES = ("playground.html", "playground.js")  # the playground, served as they are
HEALTH_TIMEOUT = 2.0  # seconds for each gRPC health check behind GET /health
# A larger request body is refused with 413 as soon as that many bytes have come in. A
# GenerateRequest is smaller than the JSON it is built from (keys, quotes, escapes, digits), so
# a body under this limit fits the orchestrator's gRPC limit; the margin is headroom.
MAX_BODY_BYTES = MAX_REQUEST_BYTES - 64 * 1024
TEMPERATURE_RANGE = (0.0, 2.0)  # OpenAI's; the gRPC API takes any finite temperature >= 0
CLIENT_CLOSED = 499  # the status logged (never delivered) for a request whose client went away

# gRPC status -> (HTTP status, OpenAI error type). RESOURCE_EXHAUSTED is a full server (its
# admission queue, or a model service's session or KV-cache caps): 429, which OpenAI's clients
# retry. gRPC's own "message larger than max" is RESOURCE_EXHAUSTED too: 413 (from_rpc).
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# The field a gRPC message names first -> the OpenAI parameter ("prompt": the endpoint's input).
PARAMS = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "speculation.lookahead": "speculation.lookahead",
    "speculation.tree_nodes": "speculation.tree_nodes",
    "max_new_tokens": "max_tokens",
    "token_ids": "prompt",
    "prompt": "prompt",
    "messages": "messages",
}
# Parameters without a GenerateRequest field: accepted only at the value that changes nothing.
NEUTRAL = {
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "echo": False,
    "suffix": "",
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}  # change no output
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options"}
# Structured output: OpenAI's response_format, and the extras vLLM names (structured_outputs, guided_*),
# each to the Constraint field it sets.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
CONSTRAINTS = {"response_format", "structured_outputs", *GUIDED}
COMMON |= CONSTRAINTS
ENDPOINTS = {  # endpoint -> (its input parameter, the parameters it takes besides COMMON)
    "chat": ("messages", {"messages", "max_completion_tokens", "speculation", "logprobs", "top_logprobs"}),
    "completions": ("prompt", {"prompt", "speculation", "logprobs"}),
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class APIError(Exception):
    """An error to send in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        code = {404: "model_not_found", 401: "invalid_api_key"}.get(self.status)
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status)

    @classmethod
    def from_rpc(
        cls, err: grpc.RpcError, endpoint: str, max_tokens: str = "max_tokens", constraint: str = "response_format"
    ) -> APIError:
        """`max_tokens`: the name the client gave max_new_tokens (max_completion_tokens in chat);
        `constraint`: the parameter that set the request's constraint."""
        status, kind = STATUS.get(err.code(), (500, "server_error"))
        message, param = err.details() or err.code().name, None
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in message:
            return cls(413, f"the request is too large for the orchestrator: {message}")
        if status == 400:
            field = message.split(" ", 1)[0].rstrip(":")
            param = {**PARAMS, "max_new_tokens": max_tokens}.get(field)
            if field.startswith("constraint"):
                param = constraint
            if param == "prompt":
                param = ENDPOINTS[endpoint][0]
            if param:
                message = param + message[len(field) :]
        return cls(status, message, param, kind)


# -- requests ----------------------------------------------------------------------------
def generate_request(body: dict, endpoint: str, model: str) -> tuple[orchestrator_pb2.GenerateRequest, dict]:
    """The GenerateRequest for an OpenAI request body, and the options of its answer
    ({"stream": bool, "include_usage": bool, "max_tokens": the parameter's name}). Raises
    APIError (400, 404) naming the parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not given" in OpenAI's API
    input_param, own = ENDPOINTS[endpoint]
    for name, value in body.items():
        if name in NEUTRAL:
            if value != NEUTRAL[name]:
                raise APIError(400, f"{name}={json.dumps(value)} is not supported by specdec", name)
        elif name not in COMMON | own | IGNORED:
            raise APIError(400, f"unknown parameter {name!r}", name)
    if body.get("model") != model:
        if "model" not in body:
            raise APIError(400, "model is required", "model")
        raise APIError(404, f"the model {body['model']!r} does not exist; this server serves {model!r}", "model")

    request = orchestrator_pb2.GenerateRequest()
    if input_param not in body:
        raise APIError(400, f"{input_param} is required", input_param)
    if endpoint == "chat":
        request.messages.messages.extend(_messages(body["messages"]))
    else:
        _set_prompt(request, body["prompt"])
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_name in body:
        request.max_new_tokens = _integer(body, max_name, 0, 2**31 - 1)
    if "temperature" in body:
        request.sampling.temperature = _number(body, "temperature", *TEMPERATURE_RANGE)
    if "top_p" in body:
        request.sampling.top_p = _number(body, "top_p")
    if "top_k" in body:
        request.sampling.top_k = _integer(body, "top_k", -(2**31), 2**31 - 1)
    if "seed" in body:
        request.seed = _integer(body, "seed", 0, 2**64 - 1)
    if "stop" in body:
        stop = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise APIError(400, "stop must be a string or a list of strings", "stop")
        request.stop_strings.extend(stop)
    if "speculation" in body:
        _set_speculation(request.speculation, body["speculation"])
    constraint = _set_constraint(request.constraint, body)
    if constraint is None:
        request.ClearField("constraint")
    logprobs = _logprobs(body, endpoint)
    if logprobs is not None:
        request.logprobs = logprobs
    options = {**_stream_options(body), "max_tokens": max_name, "constraint": constraint or "response_format"}
    return request, {**options, "logprobs": logprobs is not None}


def _messages(messages) -> list[orchestrator_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        out.append(orchestrator_pb2.ChatMessage(role=ROLES[role], content=_content(m.get("content"), i)))
    return out


def _content(content, i: int) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _set_prompt(request, prompt) -> None:
    """A string, or token ids; a list of one of them (one prompt: n = 1)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.token_ids.ids.extend(prompt)
    else:
        raise APIError(400, "prompt must be a string or a list of token ids (one prompt)", "prompt")


# speculation.rule over HTTP -> the gRPC enum
RULES = {name: orchestrator_pb2.Rule.Value(f"RULE_{name.upper()}") for name in orchestrator.RULES}


def _set_speculation(msg, value) -> None:
    if not isinstance(value, dict) or set(value) - {"lookahead", "adaptive", "disabled", "rule", "tree_nodes"}:
        raise APIError(400, "speculation takes lookahead, adaptive, disabled, rule and tree_nodes", "speculation")
    for name in ("lookahead", "tree_nodes"):
        if name in value:
            setattr(msg, name, _integer(value, name, 0, 2**31 - 1, "speculation."))
    if "rule" in value:
        if value["rule"] not in RULES:
            raise APIError(400, f"speculation.rule must be one of {', '.join(RULES)}", "speculation.rule")
        msg.rule = RULES[value["rule"]]
    for name in ("adaptive", "disabled"):
        if name in value:
            if not isinstance(value[name], bool):
                raise APIError(400, f"speculation.{name} must be true or false", f"speculation.{name}")
            setattr(msg, name, value[name])


def _set_constraint(msg: model_pb2.Constraint, body: dict) -> str | None:
    """Fill the request's Constraint from whichever parameter sets one (at most one may); the
    parameter's name, or None (response_format {"type": "text"} sets none)."""
    given = [name for name in sorted(CONSTRAINTS) if name in body]
    if given and given[0] == "response_format" and body["response_format"] == {"type": "text"}:
        given = given[1:]
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: one constraint a request ({given[0]} is given too)", given[1])
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name in GUIDED:
        _constraint_kind(msg, GUIDED[name], value, name)
    elif name == "structured_outputs":
        kinds = set(value) & set(STRUCTURED) if isinstance(value, dict) else set()
        if not isinstance(value, dict) or len(kinds) != 1 or set(value) - set(STRUCTURED):
            raise APIError(400, f"structured_outputs takes one of {', '.join(STRUCTURED)}", name)
        [kind] = kinds
        _constraint_kind(msg, STRUCTURED[kind], value[kind], f"{name}.{kind}")
    else:
        _response_format(msg, value)
    return name


def _response_format(msg, value) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object" and set(value) == {"type"}:
        msg.json_object = True
    elif kind == "json_schema" and set(value) == {"type", "json_schema"} and isinstance(value["json_schema"], dict):
        spec = value["json_schema"]
        if "schema" not in spec or set(spec) - {"name", "description", "schema", "strict"}:
            raise APIError(
                400, "response_format.json_schema takes name, description, schema and strict", "response_format"
            )
        _constraint_kind(msg, "json_schema", spec["schema"], "response_format")
    else:
        raise APIError(
            400, 'response_format is {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            '"json_schema": {"name", "schema", "strict"}}', "response_format"
        )  # fmt: skip


def _constraint_kind(msg, kind: str, value, param: str) -> None:
    """Constraint.<kind> from a parameter's value: a JSON schema as an object (or its JSON text),
    a choice as a list of strings, the others as a string."""
    if kind == "json_schema":
        if isinstance(value, str):
            msg.json_schema = value
        elif isinstance(value, (dict, bool)):
            msg.json_schema = json.dumps(value)
        else:
            raise APIError(400, f"{param} must be a JSON schema (an object)", param)
    elif kind == "json_object":
        if value is not True:
            raise APIError(400, f"{param} must be true", param)
        msg.json_object = True
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise APIError(400, f"{param} must be a non-empty list of non-empty strings", param)
        msg.choice.choices.extend(value)
    elif not isinstance(value, str) or not value:
        raise APIError(400, f"{param} must be a non-empty string", param)
    else:
        setattr(msg, kind, value)


def _logprobs(body: dict, endpoint: str) -> int | None:
    """GenerateRequest.logprobs: chat's logprobs (true) with top_logprobs, completions' logprobs (a
    count); None when not asked for."""
    if endpoint == "completions":
        return _integer(body, "logprobs", 0, MAX_LOGPROBS) if "logprobs" in body else None
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise APIError(400, "logprobs must be true or false", "logprobs")
    if "top_logprobs" in body:
        top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if not wanted:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return top
    return 0 if wanted else None


def _stream_options(body: dict) -> dict:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", "stream")
    options = body.get("stream_options", {})
    if options and not stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(400, "stream_options takes include_usage", "stream_options")
    return {"stream": stream, "include_usage": bool(options.get("include_usage", False))}


def _integer(body: dict, name: str, low: int, high: int, prefix: str = "") -> int:
    value = body[name]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise APIError(400, f"{prefix}{name} must be an integer in {low}..{high}", prefix + name)
    return value


def _number(body: dict, name: str, low: float | None = None, high: float | None = None) -> float:
    """A number; in low..high when they are given (json.loads takes NaN, which fails the check)."""
    value = body[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise APIError(400, f"{name} must be a number", name)
    if low is not None and not low <= value <= high:
        raise APIError(400, f"{name} must be a number in [{low:g}, {high:g}], got {value}", name)
    return float(value)


# -- responses ---------------------------------------------------------------------------
def usage(stats: orchestrator_pb2.GenerateStats) -> dict:
    n, m = stats.prompt_tokens, stats.generated_tokens
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

    @classmethod
    def start(cls, endpoint: str, model: str, logprobs: bool = False) -> Completion:
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        return cls(endpoint, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), logprobs)

    def _logprobs(self, entries, offset: int = 0) -> dict | None:
        """A choice's `logprobs` in the endpoint's shape (None unless asked for); `offset`: where the
        tokens' text starts in the completion (completions' text_offset)."""
        if not self.logprobs:
            return None
        if self.endpoint == "chat":
            return {"content": [_token_logprob(e, top=True) for e in entries], "refusal": None}
        offsets = list(itertools.accumulate((len(e.token) for e in entries), initial=offset))[:-1]
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{t.token: _finite(t.logprob) for t in e.top if t.logprob > -math.inf} for e in entries],
            "text_offset": offsets,
        }

    def _object(self, kind: str, choices: list, **extra) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def response(self, r: orchestrator_pb2.GenerateResponse) -> dict:
        if self.endpoint == "chat":
            choice, kind = {"message": {"role": "assistant", "content": r.text}}, "chat.completion"
        else:
            choice, kind = {"text": r.text}, "text_completion"
        choice = {"index": 0, **choice, "logprobs": self._logprobs(r.logprobs), "finish_reason": r.finish_reason}
        return self._object(kind, [choice], usage=usage(r.stats), specdec=speculation_stats(r.stats))

    def chunk(self, c: orchestrator_pb2.GenerateChunk, first: bool, include_usage: bool, offset: int = 0) -> dict:
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": c.text} if first else {"content": c.text}
            choice, kind = {"delta": delta}, "chat.completion.chunk"
        else:
            choice, kind = {"text": c.text}, "text_completion"
        logprobs = self._logprobs(c.logprobs, offset)
        choice = {"index": 0, **choice, "logprobs": logprobs, "finish_reason": c.finish_reason or None}
        r = c.rounds
        extension = {
            "spans": [[s.length, s.drafted] for s in c.spans],
            "tokens": len(c.token_ids),
            "round_counts": {"rounds": r.rounds, "draft_tokens": r.draft_tokens, "accepted_tokens": r.accepted_tokens},
        }
        if c.finish_reason:
            extension.update(speculation_stats(c.stats))
        extra = {"usage": None} if include_usage else {}
        return self._object(kind, [choice], specdec=extension, **extra)

    def usage_chunk(self, stats: orchestrator_pb2.GenerateStats) -> dict:
        kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return self._object(kind, [], usage=usage(stats))


LOWEST_LOGPROB = -9999.0  # what OpenAI reports for a token with no probability (JSON has no -inf)


def _finite(logprob: float) -> float:
    return logprob if logprob > -math.inf else LOWEST_LOGPROB


def _token_logprob(entry: orchestrator_pb2.TokenLogprob, top: bool = False) -> dict:
    """A token's entry of chat's logprobs.content (with its top_logprobs)."""
    out = {"token": entry.token, "logprob": _finite(entry.logprob), "bytes": list(entry.token_bytes)}
    if top:
        out["top_logprobs"] = [_token_logprob(t) for t in entry.top if t.logprob > -math.inf]
    return out


# -- the app -----------------------------------------------------------------------------
class Gateway:
    """The routes, over a channel to the orchestrator's gRPC API."""

    def __init__(self, channel: grpc.Channel, model: str, telemetry: Telemetry):
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        self.model = model
        self.telemetry = telemetry
        self.health_stub = health_pb2_grpc.HealthStub(channel)

    async def chat(self, request: Request):
        return await self._complete(request, "chat")

    async def completions(self, request: Request):
        return await self._complete(request, "completions")

    async def _complete(self, request: Request, endpoint: str):
        try:
            return await self._answer(request, endpoint)
        except ClientDisconnect:  # nobody to answer; its gRPC call, if any, is cancelled
            return Response(status_code=CLIENT_CLOSED)

    async def _answer(self, request: Request, endpoint: str):
        try:
            generate, options = generate_request(await read_json(request), endpoint, self.model)
        except APIError as err:
            return err.response()
        completion = Completion.start(endpoint, self.model, options["logprobs"])
        metadata = self.telemetry.trace_metadata()
        if not options["stream"]:
            call = self.stub.Generate.future(generate, metadata=metadata)
            try:
                return JSONResponse(completion.response(await _wait(request, call, call.result)))
            except grpc.RpcError as err:
                return APIError.from_rpc(err, endpoint, options["max_tokens"], options["constraint"]).response()
        call = self.stub.GenerateStream(generate, metadata=metadata)
        try:  # the first chunk before answering: a refusal (400, 429, 503) is then a status
            first = await _wait(request, call, lambda: next(call, None))
        except grpc.RpcError as err:
            return APIError.from_rpc(err, endpoint, options["max_tokens"], options["constraint"]).response()
        return EventSourceResponse(self._events(call, first, completion, options), ping=15)

    async def _events(self, call, chunk, completion: Completion, options: dict):
        include_usage = options["include_usage"]
        try:
            first, offset = True, 0
            while chunk is not None:
                yield json.dumps(completion.chunk(chunk, first, include_usage, offset))
                offset += sum(len(e.token) for e in chunk.logprobs)
                if chunk.finish_reason:
                    if include_usage:
                        yield json.dumps(completion.usage_chunk(chunk.stats))
                    break
                first = False
                chunk = await _next(call)
            yield "[DONE]"
        except grpc.RpcError as err:  # after the status line went out: an error event
            yield json.dumps(
                APIError.from_rpc(err, completion.endpoint, options["max_tokens"], options["constraint"]).body()
            )
        finally:
            call.cancel()  # a client gone away: the orchestrator frees the sessions at the next round

    async def models(self, request: Request):
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "specdec"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request):
        """The orchestrator's health and its services' availability as it sees them (its Describe):
        200 "ok"; 200 "degraded" while the draft is lost (served target-only, exactly); 503
        "unavailable" while the target is lost or the orchestrator drains."""
        body = await anyio.to_thread.run_sync(self._health)
        return JSONResponse(body, 503 if body["status"] == "unavailable" else 200)

    def _health(self) -> dict:
        try:
            reply = self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT)
            own = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            info = self.stub.Describe(model_pb2.DescribeRequest(), timeout=HEALTH_TIMEOUT)
        except grpc.RpcError as err:
            return {"status": "unavailable", "reason": f"orchestrator: {err.code().name}", "services": {}}
        services = {"orchestrator": own}
        for service in (info.draft, info.target) if info.HasField("draft") else (info.target,):
            services[service.role] = "SERVING" if service.available else "UNAVAILABLE"
        status, _, reason = info.status.partition(": ")
        if own != "SERVING":
            status, reason = "unavailable", f"orchestrator {own}"
        body = {"status": status, "services": services}
        return {**body, "reason": reason} if reason else body

    async def page(self, request: Request):
        name = request.path_params.get("name", "playground.html")
        if name not in PAGE_FILES:
            return APIError(404, f"no such page: /{name}", None, "not_found_error").response()
        return FileResponse(STATIC / name)


async def read_json(request: Request):
    """The request's body as JSON, read as it arrives: APIError 413 once it passes MAX_BODY_BYTES
    (or at once when its Content-Length says it will; whatever the header says, the count
    decides), 400 when it is not JSON."""
    too_large = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        return json.loads(body)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, "the request body is not valid JSON") from None


async def _wait(request: Request, call, wait: Callable):
    """wait(), a blocking wait on the gRPC `call`, run in a worker thread while the client is
    watched. A client that goes away first cancels the call (the orchestrator closes its
    sessions at the next round; a call still queued for admission leaves the queue), and
    ClientDisconnect is raised. The body has been read, so the next ASGI message is
    http.disconnect."""
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        call.cancel()  # ends wait()

    def outcome():  # raised in the task group's body, an error would come out as an ExceptionGroup
        try:
            return wait(), None
        except Exception as err:  # noqa: BLE001 - raised again below
            return None, err

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch)
            value, error = await anyio.to_thread.run_sync(outcome, abandon_on_cancel=True)
            tasks.cancel_scope.cancel()
    except BaseException:  # this task was cancelled (the server stops): nobody waits for the call
        call.cancel()
        raise
    if gone:
        raise ClientDisconnect
    if error is not None:
        raise error
    return value


async def _next(call) -> orchestrator_pb2.GenerateChunk | None:
    """The stream's next chunk, waited for in a worker thread; None at its end. Cancelling the
    waiting task leaves the thread to the gRPC call, which call.cancel() then ends."""
    return await anyio.to_thread.run_sync(next, call, None, abandon_on_cancel=True)


class BearerAuth:
    """ASGI middleware: `Authorization: Bearer <token>` on every route but /health and the
    playground's static files (a browser cannot send a header to load a page; the page asks for
    the token and sends it with its API calls)."""

    OPEN = {"/health", "/", *(f"/{name}" for name in PAGE_FILES)}

    def __init__(self, app, token: str):
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        if len(values) == 1 and security.bearer_matches(values[0], self.token):
            return await self.app(scope, receive, send)
        error = APIError(401, "missing or invalid bearer token (Authorization: Bearer)", None, "authentication_error")
        await error.response()(scope, receive, send)


def app(channel: grpc.Channel, model: str, token: str | None = None, telemetry: Telemetry | None = None):
    """The ASGI app over `channel` (to the orchestrator's gRPC API, carrying the token)."""
    telemetry = telemetry or disabled()
    gateway = Gateway(channel, model, telemetry)
    routes = [
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/", gateway.page, methods=["GET"]),
        Route("/{name:str}", gateway.page, methods=["GET"]),
    ]
    asgi = Starlette(routes=routes)
    if token:
        asgi = BearerAuth(asgi, token)
    return telemetry.asgi(asgi)


# -- the server --------------------------------------------------------------------------
@dataclass
class HTTPServer:
    """A running HTTP front door; stop() ends it (streams still open are cut)."""

    url: str
    _server: uvicorn.Server
    _thread: threading.Thread
    _channel: grpc.Channel

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._channel.close()


def serve_http(
    grpc_address: str,
    host: str,
    port: int,
    client_security: security.ClientSecurity,
    server_security: security.ServerSecurity,
    telemetry: Telemetry | None = None,
    model: str = "specdec",
) -> HTTPServer:
    """Serve the HTTP API on host:port (0: a free port) in a thread, for the orchestrator at
    `grpc_address` (reached with `client_security`: its TLS and token). `server_security` gives
    the HTTP port its TLS certificate and the token clients must send; plaintext only on loopback
    unless it allows otherwise."""
    security.check_bind(host, server_security, "HTTP")
    if server_security.client_ca is not None:
        raise security.SecurityError("the HTTP port does not do mutual TLS: HTTP clients authenticate with the token")
    channel = security.channel(grpc_address, client_security)
    asgi = app(channel, model, server_security.token, telemetry)
    config = uvicorn.Config(asgi, host=host, port=port, log_level="warning", lifespan="off")
    with tempfile.TemporaryDirectory() as tmp:  # uvicorn reads PEM files; ServerSecurity holds bytes
        if server_security.tls:
            config.ssl_certfile, config.ssl_keyfile = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            config.ssl_certfile.write_bytes(server_security.cert_chain)
            config.ssl_keyfile.touch(0o600)
            config.ssl_keyfile.write_bytes(server_security.private_key)
        config.load()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="specdec-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    scheme = "https" if server_security.tls else "http"
    shown = f"[{host}]" if ":" in host else host
    return HTTPServer(f"{scheme}://{shown}:{bound}", server, thread, channel)
