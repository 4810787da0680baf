"""OpenAI's request JSON into the orchestrator's gRPC API, for its HTTP front door
(orchestrator.openai_api): request JSON -> GenerateRequest, and gRPC status -> HTTP status and
OpenAI's error shape (one table). The answers' JSON: orchestrator.openai_answers.

It refuses up front only what the gRPC API has no field for (n > 1, penalties, tools, ...), so
that no parameter is silently ignored, and what OpenAI's API bounds tighter than the gRPC API
(temperature in [0, 2]). A request sets a GenerateRequest field only when the client gave the
parameter. Structured output (response_format; vLLM's structured_outputs and guided_*) becomes
GenerateRequest.constraint, logprobs / top_logprobs GenerateRequest.logprobs.
"""

from __future__ import annotations

import json
import re

import grpc
from starlette.responses import JSONResponse

import orchestrator
from orchestrator import openai_tools
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.validation import MAX_LOGPROBS, MAX_SCOPE_CHARS

TEMPERATURE_RANGE = (0.0, 2.0)  # OpenAI's; the gRPC API takes any finite temperature >= 0

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
# A model service's refusal as the orchestrator passes it on: "/pkg.Service/Method: downstream CODE: ".
DOWNSTREAM = re.compile(r"^/[\w./]+: downstream [A-Z_]+: ")
# The field a gRPC message names first -> the OpenAI parameter ("prompt": the endpoint's input).
PARAMS = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.min_p": "min_p",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.logit_bias": "logit_bias",
    "speculation.lookahead": "speculation.lookahead",
    "speculation.tree_nodes": "speculation.tree_nodes",
    "speculation.history_salt": "speculation.history_salt",  # or `user`, which sets it
    "speculation.prediction": "prediction",
    "max_new_tokens": "max_tokens",
    "stop_strings": "stop",
    "token_ids": "prompt",
    "prompt": "prompt",
    "messages": "messages",
}
# Parameters without a GenerateRequest field: accepted only at the value that changes nothing.
NEUTRAL = {
    "best_of": 1,
    "echo": False,
    "suffix": "",
    "functions": [],
    "function_call": "none",
}
# Sampling parameters that are SamplingParams fields of the same name (vLLM's extras among them).
PENALTIES = {"min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"}
IGNORED = {"user", "metadata", "store", "service_tier"}  # change no output (`user`: the history salt)
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options"}
COMMON |= PENALTIES | {"n"}
MAX_CHOICES = 16  # n at most: each choice is a generation of its own
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
TOOL_PARAMS = {"tools", "tool_choice", "parallel_tool_calls"}  # chat only: orchestrator.openai_tools
COMMON |= CONSTRAINTS
ENDPOINTS = {  # endpoint -> (its input parameter, the parameters it takes besides COMMON)
    "chat": (
        "messages",
        {"messages", "max_completion_tokens", "speculation", "logprobs", "top_logprobs", "prediction", *TOOL_PARAMS},
    ),
    "completions": ("prompt", {"prompt", "speculation", "logprobs"}),
}
# An assistant turn's tool call, as OpenAI's API gives it back (orchestrator.generation checks the same)
CALL_SHAPE = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}'
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class APIError(Exception):
    """An error to send in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        code = "model_not_found" if (self.status, self.param) == (404, "model") else None
        code = "invalid_api_key" if self.status == 401 else code
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}

    def response(self) -> JSONResponse:
        # Refused for load (429) or while the target is lost (503): "retry later", and when (the OpenAI
        # SDK's retries read it; without it they back off on their own schedule)
        retry = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), self.status, headers=retry)

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
            message = DOWNSTREAM.sub("", message)  # a model service's refusal passed on: its words name the field
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
def unknown_model(name, model: str) -> APIError:
    """404 for a model name this server does not serve (it serves `model`)."""
    return APIError(404, f"the model {name!r} does not exist; this server serves {model!r}", "model")


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
        raise unknown_model(body["model"], model)

    request = orchestrator_pb2.GenerateRequest()
    if input_param not in body:
        raise APIError(400, f"{input_param} is required", input_param)
    tools = None
    if endpoint == "chat":
        request.messages.messages.extend(_messages(body["messages"]))
        try:
            tools = openai_tools.parse(body)
        except openai_tools.ToolsError as err:
            raise APIError(400, str(err), err.param) from None
        if tools is not None:
            request.messages.tools_json = json.dumps(list(tools.tools))
    else:
        _set_prompt(request, body["prompt"])
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_name in body:
        request.max_new_tokens = _integer(body, max_name, 1, 2**31 - 1)
    if "temperature" in body:
        request.sampling.temperature = _number(body, "temperature", *TEMPERATURE_RANGE)
    if "top_p" in body:
        request.sampling.top_p = _number(body, "top_p")
    if "top_k" in body:
        request.sampling.top_k = _integer(body, "top_k", -(2**31), 2**31 - 1)
    _set_penalties(request.sampling, body)
    if "seed" in body:
        request.seed = _integer(body, "seed", 0, 2**64 - 1)
    if "stop" in body:
        stop = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise APIError(400, "stop must be a string or a list of strings", "stop")
        request.stop_strings.extend(stop)
    if "speculation" in body:
        _set_speculation(request.speculation, body["speculation"])
    if "prediction" in body:
        request.speculation.prediction = _prediction(body["prediction"])
    if "user" in body:
        if not isinstance(body["user"], str) or len(body["user"]) > MAX_SCOPE_CHARS:
            raise APIError(400, f"user must be a string of at most {MAX_SCOPE_CHARS} characters", "user")
        if not request.speculation.history_salt:
            request.speculation.history_salt = body["user"]  # an end user's answers draft only that user's
    constraint = _set_constraint(request.constraint, body)
    if tools is not None and tools.forced:  # the call's JSON, under the grammar of its schema
        if constraint is not None:
            raise APIError(400, f"{constraint} and a forced tool call cannot both constrain the answer", "tool_choice")
        request.constraint.json_schema = json.dumps(tools.schema())
        constraint = "tool_choice"
    if constraint is None:
        request.ClearField("constraint")
    logprobs = _logprobs(body, endpoint)
    if logprobs is not None:
        request.logprobs = logprobs
    options = {**_stream_options(body), "max_tokens": max_name, "constraint": constraint or "response_format"}
    n = _integer(body, "n", 1, MAX_CHOICES) if "n" in body else 1
    return request, {**options, "logprobs": logprobs is not None, "n": n, "tools": tools}


def choice_requests(request: orchestrator_pb2.GenerateRequest, n: int) -> list[orchestrator_pb2.GenerateRequest]:
    """The generations of a request's n choices: choice i's seed is the request's + i (mod 2**64), so a
    seed gives the same n texts again and choice 0 is the request with n = 1; without a seed, each
    its own random one."""
    out = []
    for i in range(n):
        choice = orchestrator_pb2.GenerateRequest()
        choice.CopyFrom(request)
        if request.HasField("seed"):
            choice.seed = (request.seed + i) % 2**64
        out.append(choice)
    return out


def assemble(chunks: list[orchestrator_pb2.GenerateChunk]) -> orchestrator_pb2.GenerateResponse:
    """A streamed generation's chunks as the unary answer it would have had."""
    out = orchestrator_pb2.GenerateResponse(text="".join(c.text for c in chunks))
    for c in chunks:
        out.token_ids.extend(c.token_ids)
        out.logprobs.extend(c.logprobs)
    if chunks:
        out.finish_reason = chunks[-1].finish_reason
        out.stats.CopyFrom(chunks[-1].stats)
    return out


def _messages(messages) -> list[orchestrator_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        calls = m.get("tool_calls") if role == "assistant" else None
        turn = orchestrator_pb2.ChatMessage(
            role=ROLES[role], content="" if content is None and calls else _content(content, f"messages[{i}].content")
        )
        if calls:
            param = f"messages[{i}].tool_calls"
            if not isinstance(calls, list):
                raise APIError(400, f"{param} must be a list", param)
            for j, call in enumerate(calls):  # the chat template reads function.name (was a 500)
                function = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                    raise APIError(400, f"{param}[{j}] must be {CALL_SHAPE}", param)
            turn.tool_calls_json = json.dumps(calls)
        if role == "tool":
            turn.tool_call_id = str(m.get("tool_call_id", ""))
        out.append(turn)
    return out


def _content(content, param: str) -> str:
    """A message's text (or a prediction's): a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise APIError(400, f"{param} must be a string or a list of text parts", param)


def _prediction(value) -> str:
    """OpenAI's predicted output, {"type": "content", "content": text}: its text."""
    if not (isinstance(value, dict) and value.get("type") == "content" and set(value) == {"type", "content"}):
        raise APIError(400, 'prediction must be {"type": "content", "content": ...}', "prediction")
    return _content(value["content"], "prediction.content")


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
    known = {"lookahead", "adaptive", "disabled", "rule", "tree_nodes", "history", "history_salt"}
    if not isinstance(value, dict) or set(value) - known:
        raise APIError(
            400,
            "speculation takes lookahead, adaptive, disabled, rule, tree_nodes, history and history_salt",
            "speculation",
        )
    for name in ("lookahead", "tree_nodes"):
        if name in value:
            setattr(msg, name, _integer(value, name, 0, 2**31 - 1, "speculation."))
    if "rule" in value:
        if value["rule"] not in RULES:
            raise APIError(400, f"speculation.rule must be one of {', '.join(RULES)}", "speculation.rule")
        msg.rule = RULES[value["rule"]]
    if "history_salt" in value:
        if not isinstance(value["history_salt"], str):
            raise APIError(400, "speculation.history_salt must be a string", "speculation.history_salt")
        msg.history_salt = value["history_salt"]
    for name in ("adaptive", "disabled", "history"):
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


def _set_penalties(sampling, body: dict) -> None:
    """min_p, the penalties and logit_bias ({"token id": bias}, OpenAI's JSON keys are strings) as
    SamplingParams fields; their ranges are checked with the rest (specdec.validation.sampling)."""
    for name in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if name in body and body[name] is not None:
            setattr(sampling, name, _number(body, name))
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must be an object of token ids to numbers", "logit_bias")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: {key!r} is not a token id", "logit_bias") from None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -(2**31) <= token < 2**31:
            raise APIError(400, f"logit_bias: the bias of token {key} must be a number", "logit_bias")
        sampling.logit_bias[token] = float(value)


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
