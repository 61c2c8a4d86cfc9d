"""Tools for /v1/chat/completions: validation, how they reach the prompt, the constraint that enforces
`tool_choice`, and reading tool calls back out of the generated text.

Prompt: when the chat template mentions `tools` it renders them itself (HF convention: `tools` is the
OpenAI list of `{"type": "function", "function": {...}}`). Otherwise radixgen adds a system prompt
(`TOOL_PROMPT`, appended to the first system message or inserted as one) listing the functions as JSON and
asking for a reply of exactly `{"name": ..., "arguments": {...}}`; past assistant tool calls are then shown
as that JSON and `tool` results as user turns "Result of <name> (<id>): <content>".

tool_choice: `none` sends no tools; `auto` lets the model answer freely and parses a JSON call out of the
text (`parse_auto`); `required` constrains the output to `{"name": one of the tools, "arguments": its
schema}` (one call); a named function constrains the output to that function's arguments schema. Both
constrained forms are JSON-schema constraints, so the arguments always parse (unless cut by max_tokens).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.tokenizer.generate_input import RequestError
from server.openai.params import check_schema

TOOL_PROMPT = (
    "You can call functions. The available functions, as JSON schemas:\n{functions}\n\n"
    "To call a function, reply with only a JSON object of the form "
    '{{"name": <function name>, "arguments": <object of arguments>}} and nothing else. '
    "Otherwise answer normally."
)
NAMED_PROMPT = "Call the function `{name}` now: reply with only its arguments as a JSON object."
REQUIRED_PROMPT = "Call one of the functions now."
_NAME_RE = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    spec: dict[str, Any]  # the request's {"type": "function", "function": {...}}
    strict: bool = False  # the arguments must validate against `parameters` (enforced by a grammar)


@dataclass(frozen=True)
class ToolPlan:
    """What the chat route does with tools: `mode` is none, auto, required or named."""

    tools: list[Tool]
    mode: str
    named: str | None = None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output must satisfy (required / named only)."""
        if self.mode == "named":
            return next(t.parameters for t in self.tools if t.name == self.named)
        options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tools(tools: Any, tool_choice: Any) -> ToolPlan:
    parsed: list[Tool] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("'tools' must be an array", "tools", "invalid_type")
        for i, t in enumerate(tools):
            parsed.append(_parse_tool(t, f"tools[{i}]"))
        names = [t.name for t in parsed]
        if len(set(names)) != len(names):
            raise RequestError("function names in 'tools' must be unique", "tools", "invalid_value")
    if tool_choice is None:
        return ToolPlan(parsed, "auto" if parsed else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"'tool_choice' must be none, auto, required or a named function, got "
                               f"{tool_choice!r}"[:200], "tool_choice", "invalid_value")
        if tool_choice != "none" and not parsed:
            raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice",
                               "missing_required_parameter")
        return ToolPlan(parsed, tool_choice)
    if not isinstance(tool_choice, dict):
        raise RequestError("'tool_choice' must be a string or an object", "tool_choice", "invalid_type")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise RequestError("a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           "tool_choice", "invalid_value")
    if not parsed:
        raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice",
                           "missing_required_parameter")
    if name not in {t.name for t in parsed}:
        raise RequestError(f"Invalid value for `function`: {name!r} is not among the tools"[:200],
                           "tool_choice.function.name", "invalid_value")
    return ToolPlan(parsed, "named", name)


def _parse_tool(t: Any, param: str) -> Tool:
    if not isinstance(t, dict):
        raise RequestError(f"'{param}' must be an object", param, "invalid_type")
    if t.get("type", "function") != "function":
        raise RequestError(f"'{param}.type' must be 'function'", f"{param}.type", "invalid_value")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"'{param}.function' is required", f"{param}.function", "missing_required_parameter")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RequestError(f"'{param}.function.name' must match [a-zA-Z0-9_.-]{{1,64}}", f"{param}.function.name",
                           "invalid_value")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise RequestError(f"'{param}.function.description' must be a string", f"{param}.function.description",
                           "invalid_type")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    check_schema(params, f"{param}.function.parameters")
    if not isinstance(params, dict):
        raise RequestError(f"'{param}.function.parameters' must be an object", f"{param}.function.parameters",
                           "invalid_type")
    strict = fn.get("strict", t.get("strict"))
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"'{param}.function.strict' must be a boolean", f"{param}.function.strict",
                           "invalid_type")
    spec = {"type": "function", "function": {"name": name, "parameters": params,
                                             **({"description": desc} if desc else {})}}
    return Tool(name, desc, params, spec, bool(strict))


def template_supports_tools(template: str) -> bool:
    return "tools" in template


def prompt_messages(messages: list[dict], plan: ToolPlan, native: bool, example: str | None = None
                    ) -> tuple[list[dict], list | None]:
    """(messages, tools) for the chat template. `native`: the template renders tools and tool turns itself.
    `example`: how a call is written in the server's tool-call format (default: radixgen's JSON object)."""
    if native:
        msgs = [_native_message(m) for m in messages]
        return msgs, [t.spec for t in plan.tools] if plan.mode != "none" and plan.tools else None
    msgs = [_plain_message(m) for m in messages]
    if plan.mode == "none" or not plan.tools:
        return msgs, None
    functions = "\n".join(json.dumps({"name": t.name, "description": t.description or "",
                                      "parameters": t.parameters}) for t in plan.tools)
    text = TOOL_PROMPT.format(functions=functions)
    if example is not None:
        text = text.replace('a JSON object of the form {"name": <function name>, "arguments": <object of arguments>}',
                            example)
    if plan.mode == "named":
        text += " " + NAMED_PROMPT.format(name=plan.named)
    elif plan.mode == "required":
        text += " " + REQUIRED_PROMPT
    if msgs and msgs[0]["role"] == "system":
        msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{text}"}
    else:
        msgs.insert(0, {"role": "system", "content": text})
    return msgs, None


def _arguments_obj(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _native_message(m: dict) -> dict:
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        fn["arguments"] = _arguments_obj(fn.get("arguments"))
        out.append({**c, "function": fn})
    return {**m, "tool_calls": out}


def _plain_message(m: dict) -> dict:
    """A message for a template that knows nothing of tools: tool calls become JSON text, tool results user
    turns."""
    role, content = m["role"], m.get("content") or ""
    if role == "tool":
        name = m.get("name") or "the function"
        call_id = m.get("tool_call_id")
        head = f"Result of {name}" + (f" ({call_id})" if call_id else "")
        return {"role": "user", "content": f"{head}: {content}"}
    calls = m.get("tool_calls")
    if role == "assistant" and calls:
        lines = [json.dumps({"name": (c.get("function") or {}).get("name"),
                             "arguments": _arguments_obj((c.get("function") or {}).get("arguments"))})
                 for c in calls]
        content = "\n".join([content, *lines]) if content else "\n".join(lines)
    return {k: v for k, v in {**m, "content": content}.items() if k not in ("tool_calls", "tool_call_id")}


# ---------------------------------------------------------------- output side


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_constrained(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """Tool calls from a required/named output; None when it does not parse (cut by max_tokens)."""
    if plan.mode == "named":
        try:
            args = json.loads(text)
        except ValueError:
            return None
        return [tool_call(plan.named or "", json.dumps(args, ensure_ascii=False))]
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    call = _as_call(obj, {t.name for t in plan.tools})
    return [call] if call is not None else None


def calls_of(plan: ToolPlan, text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, tool calls) of a finished output under `plan`: required/named outputs parse as calls (a
    named call cut short keeps its partial arguments, as OpenAI does); auto outputs are searched for calls.
    parallel=False (parallel_tool_calls): at most the first call."""
    content: str | None = text
    calls: list[dict[str, Any]] = []
    if plan.tools and plan.constrained:
        parsed = parse_constrained(plan, text)
        if parsed:
            content, calls = None, parsed
        elif plan.mode == "named":
            content, calls = None, [tool_call(plan.named or "", text)]
    elif plan.tools and plan.mode == "auto":
        content, calls = parse_auto(plan, text)
    return content, calls if parallel else calls[:1]


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or name not in names:
        return None
    args = _arguments_obj(args)
    if not isinstance(args, dict):
        return None
    return tool_call(name, json.dumps(args, ensure_ascii=False))


_TAG_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE_RE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


def parse_auto(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(remaining content or None, tool calls) from free text: `<tool_call>` blocks, fenced JSON, or JSON
    objects of the form {"name": <a tool>, "arguments": {...}} (also a list of them)."""
    names = {t.name for t in plan.tools}
    if not names:
        return text, []
    calls: list[dict[str, Any]] = []
    rest = text
    for rx in (_TAG_RE, _FENCE_RE):
        for m in list(rx.finditer(rest)):
            found = _calls_in(m.group(1), names)
            if found:
                calls.extend(found)
                rest = rest.replace(m.group(0), "", 1)
        if calls:
            break
    if not calls:
        starts = [i for i in (rest.find("{"), rest.find("[")) if i >= 0]
        if starts:
            start = min(starts)
            try:
                obj, end = json.JSONDecoder().raw_decode(rest, start)
            except ValueError:
                obj, end = None, start
            found = _calls_in_obj(obj, names)
            if found:
                calls, rest = found, rest[:start] + rest[end:]
    content = rest.strip()
    return (content or None) if calls else text, calls


def _calls_in(text: str, names: set[str]) -> list[dict[str, Any]]:
    try:
        return _calls_in_obj(json.loads(text), names)
    except ValueError:
        return []


def _calls_in_obj(obj: Any, names: set[str]) -> list[dict[str, Any]]:
    items = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(o, names) for o in items]
    return [c for c in calls if c is not None] if calls and all(c is not None for c in calls) else []


def may_be_call(text: str) -> bool:
    """Whether streamed text so far might turn out to be a tool call (then it is held back)."""
    s = text.lstrip()
    return not s or s[0] in "{[" or "<tool_call>".startswith(s[:11]) or "```".startswith(s[:3])
