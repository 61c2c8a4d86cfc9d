"""The Responses API request, translated into what the chat route already serves: chat messages, a tool plan
and a constraint.

- `input`: a string (one user turn) or a list of items: messages `{"role", "content"}` (content a string or
  `input_text`/`output_text`/`refusal` parts), `function_call` items (an earlier assistant call) and
  `function_call_output` items (its result, a `tool` turn). Images, files, reasoning items and item references
  are a 400 naming the item.
- `instructions`: a system turn placed first (not carried over to a follow-up, as OpenAI does).
- `tools`: `{"type": "function", "name", "description", "parameters", "strict"}` (function tools only);
  `tool_choice`: none, auto, required or `{"type": "function", "name"}`.
- `text.format`: text, json_object, or json_schema `{"name", "schema", "strict", "description"}`.
Anything not listed in KNOWN is a 400 naming it; listed parameters that ask for something radixgen does not
serve (background mode, include, reasoning, ...) are refused by `refuse_unserved`.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.tokenizer.generate_input import RequestError
from server.openai import params as P
from server.openai import tools as T

KNOWN = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
    "tool_choice", "parallel_tool_calls", "previous_response_id", "store", "stream", "stream_options",
    "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "truncation", "background",
    "include", "reasoning", "top_logprobs", "max_tool_calls", "prompt", "conversation",
})
_ROLES = ("user", "system", "developer", "assistant")


def refuse_unknown_and_unserved(data: Any) -> None:
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(k for k in data if k not in KNOWN)
    if unknown:
        raise RequestError(f"unsupported parameter(s): {', '.join(unknown)}"[:300], unknown[0],
                           "unsupported_parameter")
    refuse_unserved(data)


def refuse_unserved(data: dict[str, Any]) -> None:
    """A 400 naming each known parameter whose value asks for something radixgen does not do (null, false and
    the defaults pass)."""
    def no(param: str, why: str) -> RequestError:
        return RequestError(f"'{param}': {why}", param, "unsupported_parameter")

    if data.get("background"):
        raise no("background", "background responses are not supported (send stream or wait for the reply)")
    if data.get("include"):
        raise no("include", "no additional output data can be included")
    if data.get("reasoning") is not None and any(v is not None for v in (data["reasoning"] or {}).values()):
        raise no("reasoning", "this model has no reasoning mode")
    if data.get("top_logprobs"):
        raise no("top_logprobs", "logprobs are served by /v1/chat/completions, not by /v1/responses")
    if data.get("max_tool_calls") is not None:
        raise no("max_tool_calls", "not supported (parallel_tool_calls=false allows at most one call)")
    if data.get("prompt") is not None:
        raise no("prompt", "stored prompt templates are not supported")
    if data.get("conversation") is not None:
        raise no("conversation", "conversations are not stored (use previous_response_id)")
    if data.get("truncation") not in (None, "disabled"):
        raise no("truncation", "only 'disabled' is supported: a too-long input is a 400")
    text = data.get("text")
    if isinstance(text, dict) and text.get("verbosity") not in (None, "medium"):
        raise no("text.verbosity", "only 'medium' is supported")
    if isinstance(text, dict) and set(text) - {"format", "verbosity"}:
        raise no("text", f"unknown fields {sorted(set(text) - {'format', 'verbosity'})}")


# ---------------------------------------------------------------- input -> chat messages


def _part_text(part: Any, param: str) -> str:
    if not isinstance(part, dict):
        raise RequestError(f"'{param}' must be an object", param, "invalid_type")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "refusal"):
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise RequestError(f"'{param}.text' must be a string", f"{param}.text", "invalid_type")
        return text
    if kind in ("input_image", "input_file", "input_audio"):
        raise RequestError(f"'{param}': {kind} is not supported (this model takes text only)", f"{param}.type",
                           "unsupported_parameter")
    raise RequestError(f"'{param}.type' must be input_text or output_text, got {kind!r}"[:200], f"{param}.type",
                       "invalid_value")


def _content(v: Any, param: str) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise RequestError(f"'{param}' must be a string or an array of content parts", param, "invalid_type")
    return "\n".join(_part_text(p, f"{param}[{j}]") for j, p in enumerate(v))


def _string(item: dict[str, Any], key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise RequestError(f"'{param}.{key}' must be a string", f"{param}.{key}", "missing_required_parameter")
    return v


def input_messages(v: Any, names_by_call: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Chat messages for `input`. names_by_call: call_id -> function name of calls in earlier turns."""
    if v is None:
        raise RequestError("'input' is required", "input", "missing_required_parameter")
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise RequestError("'input' must be a string or a non-empty array of items", "input", "invalid_type")
    names = dict(names_by_call or {})
    out: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{p}' must be an object", p, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise RequestError(f"'{p}.role' must be one of {', '.join(_ROLES)}; got {role!r}"[:200],
                                   f"{p}.role", "invalid_value")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(item.get("content"), f"{p}.content")})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", p), _string(item, "name", p)
            names[call_id] = name
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _string(item, "arguments", p)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", p)
            out.append({"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, "the function"),
                        "content": _content(item.get("output"), f"{p}.output")})
        else:
            raise RequestError(f"'{p}.type' {kind!r} is not supported (message, function_call and "
                               f"function_call_output are)"[:300], f"{p}.type", "unsupported_parameter")
    return out


def call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}


# ---------------------------------------------------------------- tools and text.format


def tool_plan(tools: Any, tool_choice: Any) -> T.ToolPlan:
    """The chat route's ToolPlan from Responses-shaped function tools and tool_choice."""
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("'tools' must be an array", "tools", "invalid_type")
        chat_tools = []
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise RequestError(f"'tools[{i}].type' {kind!r} is not supported: only function tools are"[:200],
                                   f"tools[{i}].type", "unsupported_parameter")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
    choice = tool_choice
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise RequestError(f"'tool_choice.type' {tool_choice.get('type')!r} is not supported (function is)"
                               [:200], "tool_choice.type", "unsupported_parameter")
        choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return T.parse_tools(chat_tools, choice)


def text_format(text: Any) -> tuple[str | None, dict[str, Any]]:
    """(json_schema constraint text or None, the format to echo) for `text.format`."""
    if text is None or (isinstance(text, dict) and text.get("format") is None):
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise RequestError("'text' must be an object", "text", "invalid_type")
    fmt = text["format"]
    if not isinstance(fmt, dict):
        raise RequestError("'text.format' must be an object", "text.format", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None, fmt
    if kind == "json_object":
        return P.JSON_OBJECT_SCHEMA, fmt
    if kind != "json_schema":
        raise RequestError(f"'text.format.type' must be text, json_object or json_schema, got {kind!r}"[:200],
                           "text.format.type", "invalid_value")
    if not isinstance(fmt.get("name"), str):
        raise RequestError("'text.format.name' is required", "text.format.name", "missing_required_parameter")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise RequestError("'text.format.strict' must be a boolean", "text.format.strict", "invalid_type")
    if fmt.get("schema") is None:
        raise RequestError("'text.format.schema' is required: the JSON schema to follow",
                           "text.format.schema", "missing_required_parameter")
    return P.check_schema(fmt["schema"], "text.format.schema"), fmt


def tool_schema_constraint(plan: T.ToolPlan) -> str:
    return json.dumps(plan.schema(), separators=(",", ":"))
