"""The Messages API's event stream, translated from the chat route's chunk sequence
(server/openai/streaming.py `ChatStream`, which decides what is text and what is a tool call).

Order, as the `anthropic` client's stream helpers accumulate it: `message_start` (the message without content,
usage as known at the first output), `ping`, then per content block `content_block_start`,
`content_block_delta`... (`thinking_delta` for the reasoning a reasoning parser split out of a thinking
request's output, `text_delta`, `input_json_delta` for a tool_use block), `content_block_stop`; then
`message_delta` (`stop_reason`, `stop_sequence`, the final cumulative usage) and `message_stop`. Text streams
as it is generated (held back while an auto tool call may be coming, as in the chat stream); a named tool's
input streams as generated; other tool calls come whole after the text, as in the whole message. A failure
after the stream began is an `error` event (server/openai/streaming.py `guarded`), and the stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from server.anthropic.response import stop_reason
from server.anthropic.tools import tool_use_id


@dataclass
class _Blocks:
    """Content block bookkeeping: `index` of the next block, the kind of the one open (None: none)."""

    index: int = 0
    open: str | None = None
    out: list[dict[str, Any]] = field(default_factory=list)

    def _start(self, block: dict[str, Any]) -> None:
        self.close()
        self.open = block["type"]
        self.out.append({"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> None:
        self.out.append({"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> None:
        if self.open is not None:
            self.out.append({"type": "content_block_stop", "index": self.index})
            self.open, self.index = None, self.index + 1

    def thinking(self, text: str) -> None:
        if self.open != "thinking":
            self._start({"type": "thinking", "thinking": "", "signature": ""})
        self._delta({"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> None:
        if self.open != "text":
            self._start({"type": "text", "text": ""})
        if text:
            self._delta({"type": "text_delta", "text": text})

    def tool_use(self, call_id: str, name: str, partial_json: str) -> None:
        self._start({"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}})
        self.input_json(partial_json)

    def input_json(self, partial_json: str) -> None:
        if partial_json:
            self._delta({"type": "input_json_delta", "partial_json": partial_json})

    def take(self) -> list[dict[str, Any]]:
        out, self.out = self.out, []
        return out


@dataclass
class MessageStream:
    chunks: AsyncIterator[dict[str, Any]]  # ChatStream(..., n=1, include_usage=True).events()
    start: dict[str, Any]  # the message object as message_start carries it
    named: bool  # tool_choice names one tool: its input streams as the constrained output grows
    stop_sequences: list[str]

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "message_start", "message": self.start}
        yield {"type": "ping"}
        blocks = _Blocks()
        held: list[dict[str, Any]] = []  # whole tool calls, sent after the text
        reason, matched, usage = "stop", None, self.start["usage"]
        async for chunk in self.chunks:
            if not chunk["choices"]:  # the usage chunk, last
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                blocks.thinking(delta["reasoning_content"])
            if delta.get("content"):
                blocks.text(delta["content"])
            for call in delta.get("tool_calls") or []:
                if not self.named:
                    held.append(call)
                elif "id" in call:
                    blocks.tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
                else:
                    blocks.input_json(call["function"]["arguments"])
            if choice["finish_reason"] is not None:
                reason, matched = choice["finish_reason"], choice.get("matched_stop")
            for ev in blocks.take():
                yield ev
        stop, sequence = stop_reason(reason, matched, self.stop_sequences)
        for call in held:
            blocks.tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
        if blocks.index == 0 and blocks.open is None:  # nothing generated: one empty text block, as a message
            blocks.text("")
        blocks.close()
        for ev in blocks.take():
            yield ev
        yield {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": sequence}, "usage": usage}
        yield {"type": "message_stop"}
