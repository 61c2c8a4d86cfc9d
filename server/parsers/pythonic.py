"""pythonic (Llama 3.2 / Llama 4 and others): the answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris", unit="celsius"), get_time(tz="CET")]`, optionally between `<|python_start|>` and
`<|python_end|>`. Values are Python literals (strings, numbers, True/False/None, lists, dicts), read with
`ast.literal_eval`, never evaluated; arguments become a JSON object. A list that is not such calls stays text."""

from __future__ import annotations

import ast
import json

from server.parsers.tool_base import BaseToolParser, Block, CallTemplate, ToolCall

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(BaseToolParser):
    name = "pythonic"
    blocks = (Block("[", None, at_start_only=True, keep_start=True), Block(START, END))

    def parse_block(self, block: Block, text: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = [self._call(e) for e in tree.body.elts]
        return calls if all(calls) else None  # type: ignore[return-value]

    def _call(self, node: ast.expr) -> ToolCall | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if node.func.id not in self.tools or any(k.arg is None for k in node.keywords):
            return None
        args = {}
        for k in node.keywords:
            try:
                args[k.arg] = ast.literal_eval(k.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        try:
            return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))
        except (TypeError, ValueError):  # a set or bytes literal: no JSON spelling
            return None

    def call_template(self, name: str) -> CallTemplate | None:
        return None  # keyword arguments, not a JSON object: no JSON-schema spelling
