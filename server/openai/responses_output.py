"""Responses API output: the response object, its output items, and the SSE event sequence.

Items: the text as one `message` item (`content: [{"type": "output_text", "text", "annotations": []}]`), tool
calls as `function_call` items (`call_id`, `name`, `arguments` a JSON string). Status: `completed` when the
model stopped, `incomplete` with `incomplete_details.reason = "max_output_tokens"` when it ran out of tokens.

Stream (every event carries `sequence_number`, counting from 0): response.created, response.in_progress; for a
message item: output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done; for a function call: output_item.added, function_call_arguments.delta,
function_call_arguments.done, output_item.done; then response.completed (or response.incomplete) carrying
the whole response. Text streams as it is generated unless a tool call may be coming (auto tool_choice: held
back while it looks like JSON, as the chat stream does); tool calls come whole at the end.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.messages import FinishReason
from runtime.tokenizer.manager import RequestHandle
from server.openai import tools as T
from server.openai.common import abort_error, finish_reason


def _hex() -> str:
    return uuid.uuid4().hex


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"msg_{_hex()}", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"id": f"fc_{_hex()}", "type": "function_call", "status": "completed", "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"]}


def status_of(fr: FinishReason | None) -> tuple[str, dict[str, Any] | None]:
    """(response status, incomplete_details) for a finish reason."""
    reason = finish_reason(fr)
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(content: str | None, calls: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    items = [message_item(content, status)] if content is not None and (content or not calls) else []
    return items + [call_item(c) for c in calls]


def conversation_turn(content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """This response's output as one chat assistant message (what a follow-up continues)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return msg


@dataclass
class ResponseStream:
    """Turns one handle's cumulative results into Responses SSE events. `finish(content, calls, meta)` builds
    the final response object (and stores it); it is called once, before the last event."""

    handle: RequestHandle
    snapshot: dict[str, Any]  # the response object with status in_progress and no output yet
    plan: T.ToolPlan
    parallel: bool
    finish: Callable[[str | None, list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]], dict[str, Any]]
    seq: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)  # finished output items, in order

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self._ev("response.created", response=self.snapshot)
        yield self._ev("response.in_progress", response=self.snapshot)
        streaming = not self.plan.tools or self.plan.mode == "none"
        msg_id: str | None = None
        sent = 0
        async for item in self.handle:
            meta, text = item["meta_info"], item["text"]
            fr = meta["finish_reason"]
            err = abort_error(fr)
            if err is not None:
                raise err
            if not streaming and self.plan.mode == "auto" and not T.may_be_call(text):
                streaming = True
            if streaming and len(text) > sent:
                if msg_id is None:
                    msg_id = f"msg_{_hex()}"
                    for ev in self._open_message(msg_id):
                        yield ev
                yield self._ev("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                               delta=text[sent:], logprobs=[])
                sent = len(text)
            if fr is None:
                continue
            status, _ = status_of(fr)
            calls: list[dict[str, Any]]
            if streaming:
                content, calls = text, []
            else:
                content, calls = T.calls_of(self.plan, text, self.parallel)
            if content is not None and msg_id is None and (content or not calls):
                msg_id = f"msg_{_hex()}"
                for ev in self._open_message(msg_id):
                    yield ev
                if content:
                    yield self._ev("response.output_text.delta", item_id=msg_id, output_index=0,
                                   content_index=0, delta=content, logprobs=[])
            if msg_id is not None:
                for ev in self._close_message(msg_id, content or "", status):
                    yield ev
            for call in calls:
                for ev in self._call(call_item(call)):
                    yield ev
            response = self.finish(content, calls, meta, self.items)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield self._ev(kind, response=response)

    def _open_message(self, msg_id: str) -> list[dict[str, Any]]:
        empty = message_item("", "in_progress", msg_id)
        empty["content"] = []
        return [self._ev("response.output_item.added", output_index=len(self.items), item=empty),
                self._ev("response.content_part.added", item_id=msg_id, output_index=len(self.items),
                         content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                "logprobs": []})]

    def _close_message(self, msg_id: str, text: str, status: str) -> list[dict[str, Any]]:
        done = message_item(text, status, msg_id)
        index = len(self.items)
        self.items.append(done)
        return [self._ev("response.output_text.done", item_id=msg_id, output_index=index, content_index=0,
                         text=text, logprobs=[]),
                self._ev("response.content_part.done", item_id=msg_id, output_index=index, content_index=0,
                         part=done["content"][0]),
                self._ev("response.output_item.done", output_index=index, item=done)]

    def _call(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.items)
        self.items.append(item)
        return [self._ev("response.output_item.added", output_index=index,
                         item={**item, "status": "in_progress", "arguments": ""}),
                self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                         delta=item["arguments"]),
                self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         name=item["name"], arguments=item["arguments"]),
                self._ev("response.output_item.done", output_index=index, item=item)]
