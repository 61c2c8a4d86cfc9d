"""deepseekv3 (DeepSeek V3 / R1 chat templates): the calls sit between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`, each one
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`; V3.1's shorter
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` is read too. The markers are special tokens."""

from __future__ import annotations

import re

from server.parsers.tool_base import BaseToolParser, Block, CallTemplate, ToolCall, arguments_json

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.S)
_FENCED = re.compile(r"([^\n`]+)\n```(?:json)?\n(.*)\n```\s*", re.S)


class DeepSeekV3ToolParser(BaseToolParser):
    name = "deepseekv3"
    blocks = (Block(CALLS_BEGIN, CALLS_END),)
    special_tokens = True

    def parse_block(self, block: Block, text: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        for m in _CALL.finditer(text):
            if text[pos:m.start()].strip():
                return None
            pos = m.end()
            call = self._call(m.group(1).strip(), m.group(2))
            if call is None:
                return None
            calls.append(call)
        return calls if calls and not text[pos:].strip() else None

    def _call(self, head: str, rest: str) -> ToolCall | None:
        if head == "function":  # V3: NAME, then the arguments in a json fence
            m = _FENCED.fullmatch(rest)
            if m is None:
                return None
            name, args = m.group(1).strip(), m.group(2)
        else:
            name, args = head, rest
        js = arguments_json(args.strip())
        return ToolCall(name, js) if name in self.tools and js is not None else None

    def call_template(self, name: str) -> CallTemplate:
        return CallTemplate(f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n```json\n", f"\n```{CALL_END}{CALLS_END}",
                            CALLS_BEGIN)
