"""OpenAI's tools (orchestrator.openai_tools) through the openai client and the three services, with
tiny models whose vocabulary spells JSON.

- a forced call (a named function, or "required" among two) comes back as `tool_calls` whose
  arguments validate against the tool's schema, unary and streamed, with finish_reason "tool_calls";
- "auto" reads a call out of the text (bare, or in <tool_call> tags) and leaves other text as text;
- the tools are rendered by a chat template that has a place for them, else listed in a system turn;
  a conversation that carries an assistant's call and the tool's answer is taken;
- bad tools, an assistant's call of another shape, a tool_choice naming no tool, parallel calls and a
  forced call beside response_format are each a 400 naming the parameter; over gRPC, tools_json and
  tool_calls_json of another shape or nested too deeply are INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from orchestrator import openai_tools, prompts
from specdec.runtime.backend import HFBackend
from specdec.v1 import orchestrator_pb2
from specdec.weights.models import ModelSpec
from tests.conftest import JSON_CHARS, make_tiny_model, make_tokenizer
from tests.harness import status_of
from tests.test_openai_api import MODEL, client_for, http_json, http_pipeline

# A chat template with a place for the tools: their names (the schemas would not fit a 512-token context).
TOOLS_TEMPLATE = "{% for t in tools or [] %}tool {{ t['function']['name'] }}\n{% endfor %}"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "weather in oslo?"}]
BAD_CALL = {"id": "1", "type": "function", "function": "x"}  # an assistant's call whose function is no object


@pytest.fixture(scope="module")
def json_stack(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tools")
    target = make_tiny_model(root / "target", seed=5, chars=JSON_CHARS)
    draft = make_tiny_model(root / "draft", seed=6, like=target, noise=0.3, chars=JSON_CHARS)
    for path in (target, draft):
        tok = AutoTokenizer.from_pretrained(path)
        tok.chat_template = TOOLS_TEMPLATE + tok.chat_template
        tok.save_pretrained(path)
    backends = [HFBackend(ModelSpec(path, "cpu", "float32")) for path in (draft, target)]
    with http_pipeline(*backends) as both:
        yield both


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
def test_a_forced_call_comes_back_as_tool_calls_that_follow_the_schema(json_stack, choice):
    _, http = json_stack
    client = client_for(http)
    ask = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 160}
    for seed in (1, 2):
        reply = client.chat.completions.create(temperature=1.0, seed=seed, **ask)
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        [call] = choice_.message.tool_calls
        check_call(call)
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
    streamed, finish, name, arguments = None, None, "", ""
    for chunk in client.chat.completions.create(temperature=1.0, seed=1, stream=True, **ask):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or ():
                streamed = delta
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert streamed is not None and finish == "tool_calls"
    unary = client.chat.completions.create(temperature=1.0, seed=1, **ask).choices[0].message.tool_calls[0]
    assert (name, json.loads(arguments)) == (unary.function.name, json.loads(unary.function.arguments))


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
def test_a_forced_call_cut_by_max_tokens_is_still_a_tool_call(json_stack, choice):
    """max_tokens ending a forced call before its JSON closed gave the half-written call as content
    and tool_calls null (docs/api.md: a forced call is always tool_calls): now the call as far as it
    went, finish_reason "length", unary and streamed."""
    _, http = json_stack
    client = client_for(http)
    ask = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 24}
    reply = client.chat.completions.create(temperature=1.0, seed=1, **ask).choices[0]
    assert reply.finish_reason == "length" and reply.message.content is None
    [call] = reply.message.tool_calls
    assert call.type == "function" and call.function.name in SCHEMAS
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    streamed = [
        (c.finish_reason, d)
        for chunk in client.chat.completions.create(temperature=1.0, seed=1, stream=True, **ask)
        for c in chunk.choices
        for d in (c.delta.tool_calls or [None])
    ]
    assert streamed[-1][0] == "length" and any(
        d is not None and d.function.name == call.function.name for _, d in streamed
    )
    cut = openai_tools.Tools(tuple(TOOLS), "required").cut_call('{"name": "get_time", "arguments": {"zo')
    assert cut["function"] == {"name": "get_time", "arguments": '{"zo'}


def test_auto_reads_a_call_out_of_the_text_and_leaves_other_text():
    tools = openai_tools.parse({"tools": TOOLS})
    assert tools.choice == "auto" and tools.schema() is None
    call = tools.call('{"name": "get_time", "arguments": {"zone": "utc"}}')
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
    tagged = tools.call('<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo", "days": 2}}\n</tool_call>')
    assert json.loads(tagged["function"]["arguments"]) == {"city": "oslo", "days": 2}
    assert tools.call("it is sunny") is None
    assert tools.call('{"name": "launch", "arguments": {}}') is None  # not one of the tools
    assert openai_tools.parse({"tools": TOOLS, "tool_choice": "none"}) is None


def test_the_tools_are_rendered_by_the_template_or_listed_in_a_system_turn():
    tok = make_tokenizer(chars=JSON_CHARS)
    messages = [{"role": "user", "content": "hi"}]
    tok.chat_template = TOOLS_TEMPLATE + tok.chat_template
    placed = tok.decode(prompts._chat_ids(tok, messages, TOOLS))
    assert placed.startswith("tool get_weather\ntool get_time\n")
    plain = make_tokenizer(chars=JSON_CHARS)
    listed = plain.decode(prompts._chat_ids(plain, messages, TOOLS))
    assert listed.startswith("system: ") and "can call these tools" in listed and '"name":"get_weather"' in listed
    call = {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}
    turns = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "12"}]
    again = plain.decode(prompts._chat_ids(plain, turns, TOOLS))
    assert again.endswith('assistant: {"name": "get_time", "arguments": {"zone": "utc"}}\ntool: 12\nassistant: ')


def test_a_conversation_with_a_call_and_its_answer_is_taken(json_stack):
    _, http = json_stack
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    reply = client_for(http).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "params, param",
    [
        ({"tools": [{"type": "code"}]}, "tools"),
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": True}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [BAD_CALL]}]},
            "messages[1].tool_calls",
        ),  # was a 500
    ],
)
def test_bad_tools_are_a_400_naming_the_parameter(json_stack, params, param):
    _, http = json_stack
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **params}
    status, reply = http_json(f"{http.url}/v1/chat/completions", body)
    assert (status, reply["error"]["param"]) == (400, param), reply


DEEP = "[" * 100_000 + "]" * 100_000  # past json's decoder: RecursionError
BAD_GRPC = [  # a ChatMessages field, its JSON, the start of the refusal
    ("tools_json", '{"a": 1}', "messages.tools_json must be a list of function tools, [{"),
    ("tools_json", "5", "messages.tools_json must be a list of function tools, [{"),
    ("tools_json", "[1]", 'messages.tools_json[0] must be {"type": "function", "function": {...}}'),
    ("tools_json", '["x"]', 'messages.tools_json[0] must be {"type": "function", "function": {...}}'),
    ("tools_json", DEEP, "messages.tools_json: JSON nested too deeply"),
    ("tool_calls_json", json.dumps([BAD_CALL]), 'messages.tool_calls_json[0] must be {"id": ..., "type": "function"'),
    ("tool_calls_json", '{"a": 1}', "messages.tool_calls_json must be a list of tool calls, [{"),
    ("tool_calls_json", DEEP, "messages.tool_calls_json: JSON nested too deeply"),
]


@pytest.mark.parametrize("field, text, refused", BAD_GRPC, ids=[f"{f}-{t[:8]}" for f, t, _ in BAD_GRPC])
def test_tools_or_calls_of_another_shape_over_grpc_are_invalid_argument_naming_the_field(
    json_stack, field, text, refused
):
    """Valid JSON of another shape in the tools or an assistant's calls was INTERNAL (AttributeError,
    TypeError), and so was JSON nested past the decoder's recursion limit (RecursionError)."""
    p, _ = json_stack
    turns = [orchestrator_pb2.ChatMessage(**m) for m in MESSAGES]
    if field == "tool_calls_json":
        turns.append(orchestrator_pb2.ChatMessage(role="assistant", tool_calls_json=text))
    chat = orchestrator_pb2.ChatMessages(messages=turns, tools_json=text if field == "tools_json" else "")
    err = status_of(lambda: p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(messages=chat, max_new_tokens=4)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(refused), err.details()
    chat = orchestrator_pb2.ChatMessages(messages=turns[:1], tools_json=json.dumps(TOOLS))  # and the next is served
    assert p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(messages=chat, max_new_tokens=4)).finish_reason
