"""The Messages API's answer: the `message` object, its content blocks, `stop_reason` and `usage`.

Content: the text as one `text` block (omitted when empty beside tool calls), then one `tool_use` block per
call. stop_reason from the chat route's finish reason (server/openai/common.py reads the scheduler's):
`max_tokens` when the budget ended it, `tool_use` when it holds a call, `stop_sequence` (with `stop_sequence`
set) when one of the request's stop sequences ended it, else `end_turn`. Usage: `input_tokens` the prompt
tokens computed, `cache_read_input_tokens` those the radix cache supplied (Anthropic counts the two apart; with
the server's cache report off every prompt token is input), `output_tokens` the generated ones.
"""

from __future__ import annotations

import uuid
from typing import Any

from runtime.messages import FinishReason
from runtime.tokenizer.generate_input import RequestError
from server.anthropic.tools import tool_use_block
from server.http import ServerState
from server.openai import common as C


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def message(mid: str, model: str) -> dict[str, Any]:
    """The message object without content, stop reason or usage (message_start's snapshot)."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": None}


def chat_reason(fr: FinishReason | None, has_calls: bool) -> str:
    """The chat route's finish reason (stop, length, tool_calls, abort) of a finished output."""
    reason = C.finish_reason(fr) or "stop"
    return "tool_calls" if has_calls and reason == "stop" else reason


def stop_reason(chat: str, matched: Any, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason and what matched (a stop string or token id). An
    abort the request did not cause (an operator's) is a 500: this API has no aborted stop reason."""
    if chat == "abort":
        raise RequestError("the request was aborted by the server", None, "request_aborted", 500, "server_error")
    if chat == "length":
        return "max_tokens", None
    if chat == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def usage(state: ServerState, meta: dict[str, Any]) -> dict[str, Any]:
    u = C.usage(state, [[{"meta_info": meta}]])
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"]}


def content_blocks(content: str | None, calls: list[dict[str, Any]], reasoning: str | None = None
                   ) -> list[dict[str, Any]]:
    """A thinking block (the reasoning a reasoning parser split out), then text, then tool_use blocks; a call
    whose input is not a JSON object (cut by max_tokens) stays text."""
    blocks: list[dict[str, Any]] = []
    texts = [content] if content else []
    for call in calls:
        block = tool_use_block(call)
        if block is None:
            texts.append(call["function"]["arguments"])
        else:
            blocks.append(block)
    text = "".join(texts)
    thinking = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    return thinking + ([{"type": "text", "text": text}] if text or not blocks else []) + blocks


def complete(state: ServerState, snapshot: dict[str, Any], result: dict[str, Any], content: str | None,
             calls: list[dict[str, Any]], stop_sequences: list[str], reasoning: str | None = None
             ) -> dict[str, Any]:
    """The whole message for one finished result (`result` a TokenizerManager result dict); `reasoning`: what
    the reasoning parser split out (a thinking block first)."""
    meta = result["meta_info"]
    blocks = content_blocks(content, calls, reasoning)
    has_calls = any(b["type"] == "tool_use" for b in blocks)
    reason, seq = stop_reason(chat_reason(meta["finish_reason"], has_calls), C.matched_stop(meta["finish_reason"]),
                              stop_sequences)
    return {**snapshot, "content": blocks, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(state, meta)}
