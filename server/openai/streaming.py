"""SSE for the OpenAI routes: merging several prompts' handles, the error-chunk-then-[DONE] guard, and the
chat chunk sequence.

Chat stream, as OpenAI streams it: for each choice a first chunk whose delta carries `role: assistant`;
`reasoning_content` deltas while a thinking request thinks (server/openai/chat_output.py); content
deltas (with their tokens' logprobs when asked); tool calls as `delta.tool_calls[{index, id, type, function:
{name, arguments}}]` (with a tool-call format each call comes whole when its block closes; without one a named
tool_choice streams argument fragments, `required` and auto-detected calls come whole at the end); one chunk per choice with `finish_reason`; when `stream_options.include_usage`, a last
chunk with `choices: []` and `usage` (other chunks carry `usage: null`); then `data: [DONE]`. A failure after
the stream began (the runtime died, a grammar did not compile) is `data: {"error": {...}}` then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from runtime.tokenizer.generate_input import RequestError
from runtime.tokenizer.manager import RequestHandle
from server.errors import error_body
from server.http import SSE_DONE, sse
from server.openai import tools as T
from server.openai.chat_output import OutputPlan, OutputSplitter
from server.openai.common import abort_error, finish_reason, matched_stop
from server.openai.logprobs import LogprobFormatter

logger = logging.getLogger(__name__)
_END = object()


ErrorChunk = Callable[[RequestError], dict[str, Any]]


def openai_error_chunk(e: RequestError) -> dict[str, Any]:
    return error_body(e.message, e.type, e.param, e.code)


def sse_response(events: AsyncIterator[dict[str, Any]], named: bool = False,
                 error_chunk: ErrorChunk = openai_error_chunk, done: bool = True) -> StreamingResponse:
    return StreamingResponse(guarded(events, named, error_chunk, done), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def guarded(events: AsyncIterator[dict[str, Any]], named: bool = False,
                  error_chunk: ErrorChunk = openai_error_chunk, done: bool = True) -> AsyncIterator[bytes]:
    """SSE bytes of `events`; an error while streaming becomes `error_chunk(error)`; ends with [DONE] when
    `done`. named: each event (and an error chunk that has a `type`) also gets an `event: <its type>` line (the
    Responses and Anthropic framing)."""

    def frame(ev: dict[str, Any]) -> bytes:
        return (b"event: " + ev["type"].encode() + b"\n" + sse(ev)) if named and "type" in ev else sse(ev)

    try:
        async for ev in events:
            yield frame(ev)
    except RequestError as e:
        yield frame(error_chunk(e))
    except Exception as e:
        logger.exception("error while streaming")
        yield frame(error_chunk(RequestError(f"internal error: {type(e).__name__}", None, "internal_error", 500,
                                             "server_error")))
    if done:
        yield SSE_DONE


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(handle number, result) as results arrive from any handle; leaving early aborts them all."""
    if len(handles) == 1:
        async for item in handles[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        try:
            async for item in h:
                queue.put_nowait((i, item, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is _END:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.abort()


@dataclass
class _Choice:
    splitter: OutputSplitter
    seen: int = 0  # characters of the raw output already split
    sent: int = 0  # characters of the answer already sent (as content or arguments)
    n_calls: int = 0  # tool calls sent (a format's calls)
    lp_sent: int = 0  # output logprob entries already sent
    streaming: bool = False  # auto tools: decided that this is content, not a call
    call_id: str | None = None  # named tool_choice: the call streamed so far
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChatStream:
    """Turns one chat handle's cumulative results into chat.completion.chunk dicts."""

    handle: AsyncIterable[dict[str, Any]]  # a RequestHandle (or an iterator over its results)
    base: dict[str, Any]  # id, object, created, model, system_fingerprint
    n: int
    output: OutputPlan  # tools, reasoning, tool-call format, parallel_tool_calls
    fmt: LogprobFormatter | None  # None: no logprobs asked
    top_k: int
    include_usage: bool
    usage_of: Callable[[list[dict[str, Any]]], dict[str, Any]]  # final meta dicts -> usage dict

    @property
    def plan(self) -> T.ToolPlan:
        return self.output.tools

    @property
    def parallel(self) -> bool:
        return self.output.parallel

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {**self.base, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def _delta(self, i: int, delta: dict[str, Any], logprobs: Any = None) -> dict[str, Any]:
        return self._chunk({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None})

    def _logprobs(self, ch: _Choice, meta: dict[str, Any]) -> dict[str, Any] | None:
        if self.fmt is None:
            return None
        pairs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs")
        new = self.fmt.chat(pairs[ch.lp_sent:], tops[ch.lp_sent:] if tops else None, self.top_k)
        ch.lp_sent = len(pairs)
        return {"content": new, "refusal": None}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        choices = [_Choice(OutputSplitter(self.output)) for _ in range(self.n)]
        for i in range(self.n):
            yield self._delta(i, {"role": "assistant", "content": ""})
        async for item in self.handle:
            i, meta, text = item["index"], item["meta_info"], item["text"]
            fr = meta["finish_reason"]
            err = abort_error(fr)
            if err is not None:
                raise err
            ch = choices[i]
            for ev in self._progress(i, ch, text, meta, fr is not None):
                yield ev
            if fr is not None:
                ch.meta = meta
        if self.include_usage:
            yield {**self.base, "choices": [], "usage": self.usage_of([c.meta for c in choices])}

    def _progress(self, i: int, ch: _Choice, raw: str, meta: dict[str, Any], done: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        reasoning, text, calls = ch.splitter.feed(raw[ch.seen:], done)
        ch.seen = len(raw)
        if reasoning:
            out.append(self._delta(i, {"reasoning_content": reasoning}))
        if ch.splitter.tp is not None:
            out += self._format_progress(i, ch, text, calls, meta)
        else:
            out += self._generic_progress(i, ch, text, meta, done)
        if done:
            reason = finish_reason(meta["finish_reason"])
            if reason == "stop" and (ch.n_calls or (self.plan.mode == "named" and ch.splitter.tp is None)):
                reason = "tool_calls"
            choice = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
            stop = matched_stop(meta["finish_reason"])
            if stop is not None:
                choice["matched_stop"] = stop
            out.append(self._chunk(choice))
        return out

    def _format_progress(self, i: int, ch: _Choice, text: str, calls: list[dict[str, Any]],
                         meta: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call format's parser already split the answer from the calls."""
        out = []
        if len(text) > ch.sent:
            out.append(self._delta(i, {"content": text[ch.sent:]}, self._logprobs(ch, meta)))
            ch.sent = len(text)
        if calls:
            out.append(self._delta(i, {"tool_calls": [{"index": ch.n_calls + k, **c} for k, c in enumerate(calls)]}))
            ch.n_calls += len(calls)
        return out

    def _generic_progress(self, i: int, ch: _Choice, text: str, meta: dict[str, Any],
                          done: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        mode = self.plan.mode if self.plan.tools else "none"
        new = text[ch.sent:]
        if mode == "named":
            if ch.call_id is None:
                ch.call_id = T.new_call_id()
                out.append(self._delta(i, {"tool_calls": [{"index": 0, "id": ch.call_id, "type": "function",
                                                           "function": {"name": self.plan.named,
                                                                        "arguments": ""}}]}))
            if new:
                out.append(self._delta(i, {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}))
                ch.sent = len(text)
        elif mode == "none" or ch.streaming or (mode == "auto" and not T.may_be_call(text)):
            ch.streaming = True
            if new:
                out.append(self._delta(i, {"content": new}, self._logprobs(ch, meta)))
                ch.sent = len(text)
        elif done:  # required, or auto held back while it looked like a call
            if mode == "required":
                calls = T.parse_constrained(self.plan, text) or []  # [] when cut short: the text is content
                content = None if calls else text
            else:
                content, calls = T.parse_auto(self.plan, text)
            calls = (calls or []) if self.parallel else (calls or [])[:1]
            if calls:
                out.append(self._delta(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}))
                ch.n_calls = len(calls)
            if content:
                out.append(self._delta(i, {"content": content}, self._logprobs(ch, meta)))
            ch.sent = len(text)
        return out
