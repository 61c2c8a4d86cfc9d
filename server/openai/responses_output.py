"""Responses API output: the response object, its output items, and the SSE event sequence.

Items: a thinking request's reasoning first, as a `reasoning` item (`summary: []`, `content: [{"type":
"reasoning_text", "text"}]`, as OpenAI's open-weight models return it); the text as one `message` item (`content: [{"type": "output_text", "text", "annotations": []}]`), tool
calls as `function_call` items (`call_id`, `name`, `arguments` a JSON string). Status: `completed` when the
model stopped, `incomplete` with `incomplete_details.reason = "max_output_tokens"` when it ran out of tokens.

Stream (every event carries `sequence_number`, counting from 0): response.created, response.in_progress; for a
message item: output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done; for a function call: output_item.added, function_call_arguments.delta,
function_call_arguments.done, output_item.done; then response.completed (or response.incomplete) carrying
the whole response. A reasoning item streams first: output_item.added, reasoning_text.delta...,
reasoning_text.done, output_item.done. Text streams as it is generated unless a tool call may be coming (auto tool_choice: held
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
from server.openai.chat_output import Output, OutputPlan, OutputSplitter
from server.openai.common import abort_error, finish_reason


def _hex() -> str:
    return uuid.uuid4().hex


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"msg_{_hex()}", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"rs_{_hex()}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


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


def output_items(out: Output, status: str) -> list[dict[str, Any]]:
    items = [reasoning_item(out.reasoning)] if out.reasoning else []
    content, calls = out.content, out.calls
    items += [message_item(content, status)] if content is not None and (content or not calls) else []
    return items + [call_item(c) for c in calls]


def conversation_turn(out: Output) -> dict[str, Any]:
    """This response's output as one chat assistant message (what a follow-up continues)."""
    msg: dict[str, Any] = {"role": "assistant", "content": out.content}
    if out.reasoning:
        msg["reasoning_content"] = out.reasoning
    if out.calls:
        msg["tool_calls"] = out.calls
    return msg


@dataclass
class ResponseStream:
    """Turns one handle's cumulative results into Responses SSE events. `finish(output, meta, items)` builds
    the final response object (and stores it); it is called once, before the last event."""

    handle: RequestHandle
    snapshot: dict[str, Any]  # the response object with status in_progress and no output yet
    output: OutputPlan
    finish: Callable[[Output, dict[str, Any], list[dict[str, Any]]], dict[str, Any]]
    seq: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)  # finished output items, in order
    _reasoning_id: str | None = None
    _reasoning: str = ""

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self._ev("response.created", response=self.snapshot)
        yield self._ev("response.in_progress", response=self.snapshot)
        plan = self.output.tools
        splitter = OutputSplitter(self.output)
        # a format's parser removes calls as they close, so its answer text can stream at once
        streaming = not plan.tools or plan.mode == "none" or splitter.tp is not None
        msg_id: str | None = None
        seen = sent = 0
        found: list[dict[str, Any]] = []
        async for item in self.handle:
            meta, raw = item["meta_info"], item["text"]
            fr = meta["finish_reason"]
            err = abort_error(fr)
            if err is not None:
                raise err
            reasoning, text, calls = splitter.feed(raw[seen:], fr is not None)
            seen = len(raw)
            found += calls
            for ev in self._reason(reasoning, bool(text or calls or fr is not None)):
                yield ev
            if not streaming and plan.mode == "auto" and not T.may_be_call(text):
                streaming = True
            if streaming and len(text) > sent:
                if msg_id is None:
                    msg_id = f"msg_{_hex()}"
                    for ev in self._open_message(msg_id):
                        yield ev
                yield self._ev("response.output_text.delta", item_id=msg_id, output_index=len(self.items),
                               content_index=0, delta=text[sent:], logprobs=[])
                sent = len(text)
            if fr is None:
                continue
            for ev in self._final(text, found, splitter, streaming, msg_id, fr, meta):
                yield ev

    def _final(self, text: str, found: list[dict[str, Any]], splitter: OutputSplitter, streaming: bool,
               msg_id: str | None, fr: FinishReason, meta: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        status, _ = status_of(fr)
        if splitter.tp is not None:
            content, calls = (text or (None if found else text)), found
        elif streaming:
            content, calls = text, []
        else:
            content, calls = T.calls_of(self.output.tools, text, self.output.parallel)
        if content is not None and msg_id is None and (content or not calls):
            msg_id = f"msg_{_hex()}"
            out += self._open_message(msg_id)
            if content:
                out.append(self._ev("response.output_text.delta", item_id=msg_id, output_index=len(self.items),
                                    content_index=0, delta=content, logprobs=[]))
        if msg_id is not None:
            out += self._close_message(msg_id, content or "", status)
        for call in calls:
            out += self._call(call_item(call))
        response = self.finish(Output(self._reasoning or None, content, calls), meta, self.items)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._ev(kind, response=response))
        return out

    def _reason(self, delta: str, closing: bool) -> list[dict[str, Any]]:
        """Reasoning item events: opened by the first reasoning text, closed when the answer begins."""
        out: list[dict[str, Any]] = []
        if delta:
            if self._reasoning_id is None:
                self._reasoning_id = f"rs_{_hex()}"
                item = {**reasoning_item("", self._reasoning_id), "status": "in_progress", "content": []}
                out.append(self._ev("response.output_item.added", output_index=len(self.items), item=item))
            self._reasoning += delta
            out.append(self._ev("response.reasoning_text.delta", item_id=self._reasoning_id,
                                output_index=len(self.items), content_index=0, delta=delta))
        if closing and self._reasoning_id is not None and not any(i["id"] == self._reasoning_id for i in self.items):
            done = reasoning_item(self._reasoning, self._reasoning_id)
            index = len(self.items)
            self.items.append(done)
            out += [self._ev("response.reasoning_text.done", item_id=self._reasoning_id, output_index=index,
                             content_index=0, text=self._reasoning),
                    self._ev("response.output_item.done", output_index=index, item=done)]
        return out

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
