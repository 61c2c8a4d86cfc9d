"""Tool calls in a model family's own syntax: which format a request's output is read in, and the constraint
that makes `tool_choice` required/named and `strict: true` tools hold in that syntax.

Format: `--tool-call-parser NAME`, else the one the chat template's markers show (server/parsers
`detect_tool_parser`), else none: radixgen's generic JSON calls (server/openai/tools.py).

Constraints (a structural_tag, runtime/constrained/structural_tag.py): each tool's call is spelled by the format's
`CallTemplate` (begin, the arguments as JSON, end).
- required: the output is only calls, one or more (one with parallel_tool_calls false), to any tool;
- named: one call to that tool;
- auto with a strict tool: free text in which the format's trigger may only open a call, whose arguments
  follow the tool's schema (a non-strict tool's arguments are any JSON object).
Without a format, required/named keep the generic JSON-schema constraint (tools.py `ToolPlan.schema`) and auto
with strict tools uses the generic spelling `{"name": NAME, "arguments": ...}`.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.tokenizer.generate_input import RequestError
from server.openai import tools as T
from server.parsers import BaseToolParser, CallTemplate, create_tool_parser, detect_tool_parser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def generic_template(name: str) -> CallTemplate:
    return CallTemplate(f'{{"name": {json.dumps(name)}, "arguments": ', "}", '{"name": ')


def format_name(flag: str | None, template: str | None) -> str | None:
    """The tool-call format for this server: the flag, else the chat template's."""
    return flag or detect_tool_parser(template)


def request_parser(fmt: str | None, plan: T.ToolPlan) -> BaseToolParser | None:
    """A parser for one output of this request (None: no format, or no tools in play)."""
    if fmt is None or not plan.tools or plan.mode == "none":
        return None
    return create_tool_parser(fmt, {t.name for t in plan.tools})


def constraint(plan: T.ToolPlan, fmt: str | None, parallel: bool) -> dict[str, str] | None:
    """The sampling-params constraint tool use needs, or None."""
    if not plan.tools or plan.mode == "none":
        return None
    if fmt is None and plan.constrained:
        return {"json_schema": json.dumps(plan.schema(), separators=(",", ":"))}
    strict = [t for t in plan.tools if t.strict]
    if plan.mode == "auto" and not strict:
        return None
    parser = create_tool_parser(fmt, set()) if fmt is not None else None
    tools = [t for t in plan.tools if plan.mode != "named" or t.name == plan.named]
    structures = []
    for t in tools:
        spelled = parser.call_template(t.name) if parser is not None else generic_template(t.name)
        if spelled is None:
            what = "tool_choice" if plan.constrained else f"tools[{plan.tools.index(t)}].function.strict"
            raise RequestError(f"'{what}': the {fmt} tool-call format spells arguments as Python keywords, which "
                               "radixgen cannot constrain to a JSON schema; use tool_choice auto without strict, or "
                               "another --tool-call-parser", what, "unsupported_parameter")
        schema = t.parameters if (plan.constrained or t.strict) else ANY_OBJECT
        structures.append({"begin": spelled.begin, "schema": schema, "end": spelled.end, "trigger": spelled.trigger})
    spec: dict[str, Any] = {"structures": [{k: s[k] for k in ("begin", "schema", "end")} for s in structures],
                            "triggers": sorted({s["trigger"] for s in structures})}
    if plan.constrained:
        spec["only_tags"] = True
        if plan.mode == "named" or not parallel:
            spec["max_tags"] = 1
        if parser is not None:
            spec["separator"] = parser.call_separator()
    return {"structural_tag": json.dumps(spec, separators=(",", ":"))}


def call_example(fmt: str | None) -> str | None:
    """How a call is written in this format, for the tool prompt of a template that does not render tools."""
    if fmt is None:
        return None
    t = create_tool_parser(fmt, set()).call_template("<function name>")
    if t is None:
        return "[<function name>(<argument>=<value>, ...)]"
    return t.begin.replace('"<function name>"', "<function name>") + "<object of arguments>" + t.end
