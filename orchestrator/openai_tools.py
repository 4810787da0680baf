"""OpenAI's tools on the HTTP API: `tools` and `tool_choice` in, `tool_calls` out.

Owns: checking the tools (function tools, each a name and a JSON schema of its parameters), the
grammar a forced call is generated under, and reading a call out of the generated text. The chat
template renders the tools (orchestrator.generation). A call is a JSON object {"name": ..., "arguments":
{...}}, as the template's own format or the system turn that lists the tools asks for:

- `tool_choice` "required" or a named function: the answer is generated under the JSON schema of
  such an object (the structured-output machinery: exact under speculation), so its arguments
  follow the tool's schema; the answer is a call (finish_reason "tool_calls");
- "auto" (the default with tools): generated freely; an answer that is such an object naming one of
  the tools (alone, or in the <tool_call> tags Hermes-style templates use) is a call, else text;
- "none": the tools are not rendered and the answer is text.

One call a response: `parallel_tool_calls: true` is refused (400). Knows nothing of gRPC calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CHOICES = ("none", "auto", "required")


class ToolsError(ValueError):
    """A request's tools refused: the message, and the parameter it names (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


TAGGED = re.compile(r"^\s*<tool_call>\s*(.*?)\s*</tool_call>\s*$", re.DOTALL)
# The start of a forced call (its schema: name first, then arguments), cut anywhere after it
CUT_CALL = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"arguments"\s*:\s*(.*))?', re.DOTALL)


@dataclass(frozen=True)
class Tools:
    """A request's tools and what it allows of them."""

    tools: tuple[dict, ...]  # OpenAI's function tools, as sent
    choice: str  # "auto", "required" or a tool's name ("none": no Tools at all)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def schema(self) -> dict | None:
        """The JSON schema a forced call is generated under; None for "auto"."""
        if not self.forced:
            return None
        wanted = self.names if self.choice == "required" else [self.choice]
        calls = [_call_schema(t["function"]) for t in self.tools if t["function"]["name"] in wanted]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def cut_call(self, text: str) -> dict:
        """A forced call that max_tokens cut (finish_reason "length"): its name, and its arguments as
        far as they were written (JSON cut short, as OpenAI returns them); the name the choice forces
        where the text was cut before it."""
        found = CUT_CALL.match(text)
        if found is None:
            return _call("" if self.choice == "required" else self.choice, "")
        return _call(json.loads(f'"{found.group(1)}"'), found.group(2) or "")

    def call(self, text: str) -> dict | None:
        """The tool call the generated `text` makes (OpenAI's tool_calls entry), or None for text."""
        tagged = TAGGED.match(text)
        try:
            value = json.loads(tagged.group(1) if tagged else text)
        except ValueError:
            return None
        if not (isinstance(value, dict) and value.get("name") in self.names):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        return _call(value["name"], json.dumps(arguments, ensure_ascii=False))


def _call(name: str, arguments: str) -> dict:
    """OpenAI's tool_calls entry."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse(body: dict) -> Tools | None:
    """The request's tools (None: none, or tool_choice "none"); ToolsError naming the parameter."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not isinstance(tools, list):
        raise ToolsError("tools must be a list of function tools", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            raise ToolsError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolsError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise ToolsError("tools: two tools have one name", "tools")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if name not in names:
            raise ToolsError(f"tool_choice names no tool of tools ({', '.join(names) or 'none'})", "tool_choice")
        choice = name
    elif choice is None:
        choice = "auto"
    elif choice not in CHOICES:
        raise ToolsError('tool_choice must be "none", "auto", "required" or a named function', "tool_choice")
    elif choice == "required" and not tools:
        raise ToolsError('tool_choice "required" needs tools', "tool_choice")
    if body.get("parallel_tool_calls") and tools and choice != "none":
        raise ToolsError(
            "parallel_tool_calls: specdec makes at most one call a response; send false", "parallel_tool_calls"
        )
    if not tools or choice == "none":
        return None
    return Tools(tuple(tools), choice)
