"""mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects (Mistral 7B v0.3, Nemo, Small),
or the newer spelling `[TOOL_CALLS]name[ARGS]{...}` repeated per call (tokenizer v11+). Text before the marker
is the answer; the calls run to the end of the output. `[TOOL_CALLS]` is a special token."""

from __future__ import annotations

import json

from server.parsers.tool_base import (
    BaseToolParser,
    Block,
    CallTemplate,
    ToolCall,
    arguments_json,
    call_from_obj,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(BaseToolParser):
    name = "mistral"
    blocks = (Block(MARKER, None),)
    special_tokens = True

    def parse_block(self, block: Block, text: str) -> list[ToolCall] | None:
        if ARGS in text:
            return self._named_args(text)
        calls: list[ToolCall] = []
        for part in text.split(MARKER):  # one array per marker (a constrained output may repeat it)
            try:
                obj = json.loads(part)
            except ValueError:
                return None
            items = obj if isinstance(obj, list) else [obj]
            found = [call_from_obj(o, self.tools, ("arguments",)) for o in items]
            if not items or not all(found):
                return None
            calls += found  # type: ignore[arg-type]
        return calls

    def _named_args(self, text: str) -> list[ToolCall] | None:
        calls = []
        for part in text.split(MARKER):
            name, sep, args = part.partition(ARGS)
            name = name.strip()
            if not sep or name not in self.tools:
                return None
            js = arguments_json(args.strip())
            if js is None:
                return None
            calls.append(ToolCall(name, js))
        return calls or None

    def call_template(self, name: str) -> CallTemplate:
        return CallTemplate(f'{MARKER}[{{"name": {json.dumps(name)}, "arguments": ', "}]", MARKER)
