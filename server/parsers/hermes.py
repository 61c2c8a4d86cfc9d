"""qwen25 (Hermes-style, Qwen2.5 / Qwen3 chat templates): each call is a JSON object in its own block,
`<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`, answer text around the
blocks. A block cut before `</tool_call>` is still a call when its JSON is complete."""

from __future__ import annotations

import json

from server.parsers.tool_base import BaseToolParser, Block, CallTemplate, ToolCall, call_from_obj

START, END = "<tool_call>", "</tool_call>"


class Qwen25ToolParser(BaseToolParser):
    name = "qwen25"
    blocks = (Block(START, END),)

    def parse_block(self, block: Block, text: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        call = call_from_obj(obj, self.tools, ("arguments",))
        return [call] if call else None

    def call_template(self, name: str) -> CallTemplate:
        return CallTemplate(f'{START}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{END}", START)
