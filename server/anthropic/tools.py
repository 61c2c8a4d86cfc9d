"""Anthropic tools on the chat route's tool machinery (server/openai/tools.py): `tools` with `input_schema`
become function tools, `tool_choice` a `ToolPlan`, and the chat tool calls read back out of the text become
`tool_use` blocks.

tool_choice: `auto` (the default with tools) lets the model answer freely and parses a call out of the text
with the chat route's parser; `any` constrains the output to `{"name": one of the tools, "arguments": its
schema}` and `tool` to the named tool's `input_schema` (JSON-schema constraints on the grammar backend, so the
input always validates unless max_tokens cuts it); `none` sends no tools. `disable_parallel_tool_use` keeps at
most one call.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from runtime.tokenizer.generate_input import RequestError
from server.openai import tools as T

_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# The chat validator's parameter paths -> Anthropic's (its tools are flat: no `function` object).
_PATHS = ((".function.parameters", ".input_schema"), (".function.description", ".description"),
          (".function.name", ".name"), ("tool_choice.function.name", "tool_choice.name"))


class Tools(NamedTuple):
    plan: T.ToolPlan
    parallel: bool  # False: at most one tool_use block


def _anthropic_names(e: RequestError) -> RequestError:
    for chat, ours in _PATHS:
        e.message = e.message.replace(chat, ours)
        e.param = e.param.replace(chat, ours) if e.param else e.param
    return e


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be an array", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise RequestError(f"'{p}' must be an object", p, "invalid_type")
        if t.get("type") not in (None, "custom"):
            raise RequestError(f"'{p}.type' {t.get('type')!r}: server tools are not supported (custom tools with an "
                               "input_schema are)"[:200], f"{p}.type", "unsupported_parameter")
        extra = sorted(set(t) - _TOOL_KEYS)
        if extra:
            raise RequestError(f"'{p}.{extra[0]}' is not supported on a tool", f"{p}.{extra[0]}",
                               "unsupported_parameter")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise RequestError(f"'{p}.strict' must be a boolean", f"{p}.strict", "invalid_type")
        if not isinstance(t.get("input_schema"), dict):
            raise RequestError(f"'{p}.input_schema' is required: the JSON schema of the tool's input",
                               f"{p}.input_schema", "missing_required_parameter")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_choice(v: Any) -> tuple[Any, bool]:
    """(the chat route's tool_choice, parallel) for Anthropic's tool_choice object."""
    if v is None:
        return None, True
    if not isinstance(v, dict):
        raise RequestError("'tool_choice' must be an object such as {\"type\": \"auto\"}", "tool_choice",
                           "invalid_type")
    kind = v.get("type")
    extra = sorted(set(v) - {"type", "name", "disable_parallel_tool_use"})
    if extra:
        raise RequestError(f"'tool_choice.{extra[0]}' is not supported", f"tool_choice.{extra[0]}",
                           "unsupported_parameter")
    off = v.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise RequestError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                           "tool_choice.disable_parallel_tool_use", "invalid_type")
    if kind == "tool":
        if not isinstance(v.get("name"), str):
            raise RequestError("'tool_choice.name' is required when tool_choice.type is tool", "tool_choice.name",
                               "missing_required_parameter")
        return {"type": "function", "function": {"name": v["name"]}}, not off
    if kind not in _CHOICES:
        raise RequestError(f"'tool_choice.type' must be auto, any, tool or none; got {kind!r}"[:200],
                           "tool_choice.type")
    return _CHOICES[kind], not off


def parse(tools: Any, tool_choice: Any) -> Tools:
    try:
        choice, parallel = _chat_choice(tool_choice)
        return Tools(T.parse_tools(_chat_tools(tools), choice), parallel)
    except RequestError as e:
        raise _anthropic_names(e) from None


def tool_use_id(call_id: str) -> str:
    """Anthropic-style ids for the chat route's call ids (`call_<hex>` -> `toolu_<hex>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use_block(call: dict[str, Any]) -> dict[str, Any] | None:
    """A chat tool call as a `tool_use` block; None when its arguments are not a JSON object (a named call cut
    short by max_tokens)."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"], "input": args}
