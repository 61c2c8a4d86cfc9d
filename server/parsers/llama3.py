"""llama3 (Llama 3.1 / 3.2 JSON tool calling): the whole answer is one call `{"name": "f", "parameters": {...}}`
(several separated by `;`), or text then `<|python_tag|>` and the call(s). `arguments` is accepted for
`parameters`. A leading `{` that is not a call to one of the tools stays answer text."""

from __future__ import annotations

import json

from server.parsers.tool_base import BaseToolParser, Block, CallTemplate, ToolCall, call_from_obj, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3ToolParser(BaseToolParser):
    name = "llama3"
    blocks = (Block("{", None, at_start_only=True, keep_start=True), Block(PYTHON_TAG, None))

    def parse_block(self, block: Block, text: str) -> list[ToolCall] | None:
        values = json_values(text, ";")
        if values is None:
            return None
        calls = [call_from_obj(v, self.tools) for v in values]
        return calls if all(calls) else None  # type: ignore[return-value]

    def call_template(self, name: str) -> CallTemplate:
        return CallTemplate(f'{{"name": {json.dumps(name)}, "parameters": ', "}", '{"name": ')

    def call_separator(self) -> str:
        return "; "
