"""Anthropic's `system` and `messages` translated into the chat messages every chat-shaped route renders
(server/openai/chat.py `render_chat`): `{"role": system|user|assistant|tool, "content": str | None,
"tool_calls"?, "tool_call_id"?, "name"?}`.

- `system`: a string or text blocks, one system turn first (none when empty).
- `messages[i]`: `role` user or assistant; `content` a string or blocks. Text blocks of one message join with
  newlines. An assistant's `tool_use` blocks become its `tool_calls` (`input` as the JSON arguments); a user's
  `tool_result` blocks become `tool` turns (text content; `is_error` prefixes "Error: "), in block order with
  the user's text between them. A final assistant message is a prefill: the answer continues it.
- `cache_control` on a block is accepted and changes nothing (the radix cache reuses every shared prefix by
  itself). Images, documents, citations, thinking and server-tool blocks are a 400 naming the block.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from runtime.tokenizer.generate_input import RequestError

ROLES = ("user", "assistant")
# Blocks Anthropic defines that radixgen cannot honour (text-only model, no server tools, no reasoning parser).
UNSERVED_BLOCKS = frozenset({
    "image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use",
    "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "tool_search_tool_result",
    "mcp_tool_use", "mcp_tool_result", "container_upload",
})
_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}


class Conversation(NamedTuple):
    messages: list[dict[str, Any]]  # chat messages, system first when given
    prefill: bool  # the last message is the assistant's: continue it instead of starting a new turn


def _bad(message: str, param: str, code: str = "invalid_value") -> RequestError:
    return RequestError(message, param, code)


def _check_block(block: Any, param: str, allowed: tuple[str, ...]) -> str:
    """The block's type, after checking it is an object of a served type with only known keys."""
    if not isinstance(block, dict):
        raise _bad(f"'{param}' must be an object", param, "invalid_type")
    kind = block.get("type")
    if kind in UNSERVED_BLOCKS:
        raise _bad(f"'{param}': {kind} blocks are not supported by this server (text, tool_use and tool_result "
                   "are)", f"{param}.type", "unsupported_parameter")
    if kind not in allowed:
        raise _bad(f"'{param}.type' must be one of {', '.join(allowed)}; got {kind!r}"[:200], f"{param}.type")
    extra = sorted(set(block) - _BLOCK_KEYS[kind])
    if extra:
        raise _bad(f"'{param}.{extra[0]}' is not supported on a {kind} block", f"{param}.{extra[0]}",
                   "unsupported_parameter")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise _bad(f"'{param}.text' must be a string", f"{param}.text", "invalid_type")
        if block.get("citations"):
            raise _bad(f"'{param}.citations': citations are not supported", f"{param}.citations",
                       "unsupported_parameter")
    return kind


def system_text(v: Any) -> str | None:
    if v is None or v == "":
        return None
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise _bad("'system' must be a string or an array of text blocks", "system", "invalid_type")
    texts = []
    for j, block in enumerate(v):
        _check_block(block, f"system[{j}]", ("text",))
        texts.append(block["text"])
    return "\n".join(texts) or None


def _tool_result_text(block: dict[str, Any], param: str) -> str:
    v = block.get("content")
    if v is None:
        text = ""
    elif isinstance(v, str):
        text = v
    elif isinstance(v, list):
        parts = []
        for j, inner in enumerate(v):
            _check_block(inner, f"{param}.content[{j}]", ("text",))
            parts.append(inner["text"])
        text = "\n".join(parts)
    else:
        raise _bad(f"'{param}.content' must be a string or an array of text blocks", f"{param}.content",
                   "invalid_type")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _bad(f"'{param}.is_error' must be a boolean", f"{param}.is_error", "invalid_type")
    return f"Error: {text}" if is_error else text


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise _bad(f"'{param}.{key}' must be a non-empty string", f"{param}.{key}", "missing_required_parameter")
    if not isinstance(block.get("input"), dict):
        raise _bad(f"'{param}.input' must be an object", f"{param}.input", "invalid_type")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _assistant(content: list, param: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(content):
        p = f"{param}[{j}]"
        if _check_block(block, p, ("text", "tool_use")) == "text":
            texts.append(block["text"])
        else:
            calls.append(_tool_use(block, p))
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(content: list, param: str, names: dict[str, str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        p = f"{param}[{j}]"
        if _check_block(block, p, ("text", "tool_result")) == "text":
            texts.append(block["text"])
            continue
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"'{p}.tool_use_id' must be a non-empty string", f"{p}.tool_use_id",
                       "missing_required_parameter")
        out.append({"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, "the function"),
                    "content": _tool_result_text(block, p)})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def conversation(system: Any, messages: Any) -> Conversation:
    if messages is None:
        raise _bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _bad("'messages' must be an array", "messages", "invalid_type")
    if not messages:
        raise _bad("'messages' must not be empty", "messages", "empty_array")
    sys_text = system_text(system)
    out: list[dict[str, Any]] = [{"role": "system", "content": sys_text}] if sys_text is not None else []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool turns that answer it
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{p}' must be an object", p, "invalid_type")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise _bad(f"'{p}.{extra[0]}' is not a message field (role and content are)", f"{p}.{extra[0]}",
                       "unsupported_parameter")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise _bad(f"'{p}.role' must be user or assistant; got {role!r}"[:200], f"{p}.role")
        if content is None:
            raise _bad(f"'{p}.content' is required", f"{p}.content", "missing_required_parameter")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"'{p}.content' must be a string or an array of content blocks", f"{p}.content",
                       "invalid_type")
        if role == "assistant":
            msg = _assistant(content, f"{p}.content")
            names.update({c["id"]: c["function"]["name"] for c in msg.get("tool_calls") or []})
            out.append(msg)
        else:
            out.extend(_user(content, f"{p}.content", names))
    prefill = messages[-1].get("role") == "assistant"
    if prefill and out[-1].get("tool_calls"):
        raise _bad("a final assistant message (a prefill to continue) may hold only text, not tool_use blocks",
                   f"messages[{len(messages) - 1}].content")
    if prefill and not out[-1]["content"]:  # an empty prefill continues nothing: a plain new turn
        out.pop()
        prefill = False
    return Conversation(out, prefill)
