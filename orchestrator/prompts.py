"""A request's prompt as token ids, and token ids as text: the tokenizer fetched from the target
service (load_tokenizer: the orchestrator's host needs no model files), a prompt string or chat turns
(with OpenAI's tools and tool calls) through it, and encode / decode as the scheduler's thread needs
them. Knows nothing of rounds or of the rule.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from orchestrator import openai_tools, scheduler
from specdec import validation
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import model_pb2, orchestrator_pb2

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's system turn
# Where a chat template has no place for tools: a system turn that lists them and says how to call one.
TOOLS_TURN = (
    "You can call these tools (JSON schemas of their parameters):\n{tools}\n"
    'To call one, answer with a JSON object {{"name": ..., "arguments": {{...}}}} and nothing else.'
)
# OpenAI's shapes of the two JSON fields of ChatMessages (docs/api.md: tools)
TOOLS_SHAPE = '[{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}]'
CALL_SHAPE = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}'


def load_tokenizer(files: model_pb2.GetTokenizerResponse):
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for f in files.files:
            (Path(tmp) / Path(f.name).name).write_bytes(f.content)
        return AutoTokenizer.from_pretrained(tmp)


def decode(tok, ids: list[int]) -> str:
    """tok.decode(ids, skip_special_tokens=True) for a list of token ids. transformers' decode first
    converts its argument element by element (to_py_obj), which cost more than the decode itself in
    a generation's per-round text (~12% of the orchestrator's CPU at 64 clients); a flat list of ints
    goes straight to the `_decode` it then calls. Looked up on the class: a wrapper that forwards
    other attributes to a tokenizer (continuation.ContinuedTokenizer) keeps its own decode."""
    fast = getattr(type(tok), "_decode", None)
    return fast(tok, ids, skip_special_tokens=True) if fast is not None else tok.decode(ids, skip_special_tokens=True)


OFFLOADED_CHARS = 8192  # a text's characters past which encode() runs off the scheduler's thread (~6 ms)


def encode(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    """tok.encode(text, add_special_tokens=...) for one string. transformers' encode runs the backend's
    encode_batch, which lets go of the interpreter's lock while it runs: on the scheduler's thread
    under load, taking it back waited for another thread's switch interval (5 ms) a prompt, and 256
    clients' requests queued behind it. The backend's own encode of one string (the same ids, where
    no truncation or padding is set on it) keeps the lock; a tokenizer without a backend is asked
    as before. A text past OFFLOADED_CHARS is encoded by encode_batch on a thread, the scheduler's
    other tasks running meanwhile: kept on the scheduler's thread, a 3.9 MB prompt (~0.75 µs a
    character) stopped every generation in flight for 7-9 s."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or backend.truncation or backend.padding:
        return scheduler.offload(tok.encode, text, add_special_tokens=add_special_tokens)
    split = bool(getattr(tok, "split_special_tokens", False))
    if backend.encode_special_tokens != split:  # as transformers sets it before each call
        backend.encode_special_tokens = split
    if len(text) > OFFLOADED_CHARS:
        return scheduler.offload(lambda: backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def prompt_ids(pair, request: orchestrator_pb2.GenerateRequest) -> list[int]:
    """A request's prompt as token ids (token ids as sent, a prompt string, or chat turns through the
    target's chat template), checked against `pair` (a generation.ModelPair: its tokenizer and vocabulary)."""
    tok = pair.tokenizer
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids must not be empty")
        validation.token_ids(ids, pair.vocab_size, "token_ids")
    elif kind == "messages":
        messages = [_turn(m) for m in request.messages.messages]
        if not messages:
            raise InvalidArgument("messages must not be empty")
        roles = [m.role for m in request.messages.messages if m.role not in CHAT_ROLES]
        if roles:
            raise InvalidArgument(f"messages: unknown role {roles[0]!r} (one of {', '.join(CHAT_ROLES)})")
        if not tok.chat_template:
            raise FailedPrecondition("messages: the target model has no chat template")
        ids = _chat_ids(tok, messages, _json(request.messages.tools_json, "messages.tools_json"))
    elif kind == "prompt":
        if not request.prompt:
            raise InvalidArgument("prompt must not be empty")
        if request.chat_template and tok.chat_template:
            ids = _chat_ids(tok, [{"role": "user", "content": request.prompt}])
        else:
            ids = encode(tok, request.prompt)
    else:
        raise InvalidArgument("one of prompt, messages or token_ids must be set")
    if not ids:
        raise InvalidArgument("the prompt is empty")
    return ids


def _turn(m: orchestrator_pb2.ChatMessage) -> dict:
    """A ChatMessage as a chat template reads it."""
    turn = {"role": "system" if m.role == "developer" else m.role, "content": m.content}  # as a template knows it
    if m.tool_call_id:
        turn["tool_call_id"] = m.tool_call_id
    if m.tool_calls_json:
        calls = _json(m.tool_calls_json, "messages.tool_calls_json")
        if not isinstance(calls, list):
            raise InvalidArgument(f"messages.tool_calls_json must be a list of tool calls, [{CALL_SHAPE}]")
        for i, call in enumerate(calls):  # a template reads function.name and .arguments
            function = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                raise InvalidArgument(f"messages.tool_calls_json[{i}] must be {CALL_SHAPE}")
            if isinstance(function.get("arguments"), str):  # templates read the arguments as an object
                with contextlib.suppress(ValueError, RecursionError):
                    function["arguments"] = json.loads(function["arguments"])
        turn["tool_calls"] = calls
    return turn


def _json(text: str, field: str):
    """A JSON field of the request (None where empty); InvalidArgument naming it where it is not JSON."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as err:
        raise InvalidArgument(f"{field}: not valid JSON ({err})") from None
    except RecursionError:  # json's C decoder, past the interpreter's recursion limit
        raise InvalidArgument(f"{field}: JSON nested too deeply") from None


def _called(turn: dict) -> dict:
    """An assistant turn's tool calls as the JSON text the system turn asks for (one a line)."""
    calls = [c.get("function", {}) for c in turn["tool_calls"] if isinstance(c, dict)]
    text = "\n".join(json.dumps({"name": f.get("name"), "arguments": f.get("arguments", {})}) for f in calls)
    return {"role": turn["role"], "content": "\n".join(t for t in (turn.get("content") or "", text) if t)}


def _chat_ids(tok, messages, tools=None) -> list[int]:
    """The prompt's ids under the target's chat template; `tools` (OpenAI's array) rendered by it, or
    in a system turn where it has no place for them (its source never names `tools`)."""
    if tools is not None:
        _check_tools(tools)
    source = tok.chat_template if isinstance(tok.chat_template, str) else str(tok.chat_template)
    try:  # tools or calls that parsed may still be nested too deeply to write out (json.dumps, tojson)
        if "tools" not in source:
            # the calls made so far as the text that makes them (the template renders content only)
            messages = [_called(m) if m.get("tool_calls") else m for m in messages]
            if tools:
                listed = TOOLS_TURN.format(tools=json.dumps([t["function"] for t in tools], separators=(",", ":")))
                if messages[0]["role"] == "system":
                    messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + listed}, *messages[1:]]
                else:
                    messages = [{"role": "system", "content": listed}, *messages]
            tools = None
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except RecursionError:
        raise InvalidArgument("messages: the tools or tool calls are nested too deeply") from None
    return encode(tok, text, add_special_tokens=False)  # as apply_chat_template's tokenize does


def _check_tools(tools) -> None:
    """messages.tools_json checked as the HTTP API checks `tools` (orchestrator.openai_tools): a template
    reads each tool's function.name; InvalidArgument naming the field and the shape."""
    if not isinstance(tools, list):
        raise InvalidArgument(f"messages.tools_json must be a list of function tools, {TOOLS_SHAPE}")
    try:
        openai_tools.parse({"tools": tools})
    except openai_tools.ToolsError as err:  # "tools[0] must be ..." -> "messages.tools_json[0] must be ..."
        raise InvalidArgument("messages.tools_json" + str(err).removeprefix("tools")) from None
