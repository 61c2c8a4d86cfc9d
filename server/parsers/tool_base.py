"""The streaming tool-call parser every format shares.

A format is a list of `Block`s: a start marker, an end marker (None: the call region runs to the end of the
output) and whether the start counts only at the very beginning of the output (llama3's bare `{`, pythonic's
`[`). Text outside blocks is the answer. A block's text goes to the format's `parse_block`, which returns the
calls it holds, or None when it is not a well-formed call to one of the request's tools: then the whole block
stays answer text, markers included (text that merely looks like a call is never turned into one).

Streaming: answer text is emitted as soon as it cannot be the start of a marker; a block is held until its end
marker (or the end of the output) and then emitted whole: its calls, or its text. Whitespace that only separates
the answer from a call is dropped. `parse(text)` is `feed(text)` + `finish()` on a fresh parser, so the
concatenated deltas of any split of an output equal the one-piece result (tests check every split).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from server.parsers.markers import find_first, held_suffix, split_trailing_space


class ToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object as compact text (ensure_ascii off)


class ToolResult(NamedTuple):
    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class Block:
    start: str
    end: str | None
    at_start_only: bool = False
    keep_start: bool = False  # the start marker is part of the call text (a bare `{` or `[`)


@dataclass(frozen=True)
class CallTemplate:
    """How one call to `name` is spelled, for constraining: `begin` + arguments JSON + `end`, and the trigger
    (a prefix of `begin` that free text may not contain under a structural constraint)."""

    begin: str
    end: str
    trigger: str


@dataclass
class _State:
    mode: str = "text"  # text | block
    buf: str = ""
    block: Block | None = None
    block_prefix: str = ""  # the whitespace and marker text that opened the current block (re-emitted if bad)
    pending_space: str = ""  # trailing whitespace of the answer, held until text follows (dropped before a call)
    after_call: bool = False  # nothing but whitespace since the last call
    at_beginning: bool = True  # nothing but whitespace so far
    calls: list[ToolCall] = field(default_factory=list)


class BaseToolParser:
    """One format's parser for one request: `tools` are the request's function names."""

    name = ""
    blocks: tuple[Block, ...] = ()
    special_tokens = False  # markers are special tokens (decode with skip_special_tokens off)

    def __init__(self, tools: frozenset[str] | set[str]) -> None:
        self.tools = frozenset(tools)
        self._s = _State()

    # ------------------------------------------------------------ the format

    def parse_block(self, block: Block, text: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def call_template(self, name: str) -> CallTemplate | None:
        """The spelling of one call to `name` (None: arguments are not JSON in this format)."""
        raise NotImplementedError

    def call_separator(self) -> str:
        """Text between two calls of a constrained output (several calls in one block where the format does)."""
        return "\n"

    # ------------------------------------------------------------ streaming

    def feed(self, delta: str) -> ToolResult:
        s = self._s
        s.buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while self._step(out, calls):
            pass
        return ToolResult("".join(out), calls)

    def finish(self) -> ToolResult:
        s = self._s
        out: list[str] = []
        calls: list[ToolCall] = []
        if s.mode == "block":
            self._close_block(s.buf, "", out, calls)
        else:
            self._text(s.buf, out)
        s.buf = ""
        out.append(s.pending_space)
        s.pending_space = ""
        return ToolResult("".join(out), calls)

    def parse(self, text: str) -> ToolResult:
        p = type(self)(self.tools)
        a, b = p.feed(text), p.finish()
        return ToolResult(a.content + b.content, a.calls + b.calls)

    def _step(self, out: list[str], calls: list[ToolCall]) -> bool:
        s = self._s
        if s.mode == "block":
            assert s.block is not None
            if s.block.end is None:
                return False
            i = s.buf.find(s.block.end)
            if i < 0:
                return False
            body, s.buf = s.buf[:i], s.buf[i + len(s.block.end):]
            self._close_block(body, s.block.end, out, calls)
            return True
        if s.at_beginning:
            lead = s.buf.lstrip()
            for b in self.blocks:
                if b.at_start_only and lead.startswith(b.start):
                    self._open(b, s.buf[:len(s.buf) - len(lead)], lead)
                    return True
            if any(b.at_start_only and b.start.startswith(lead) for b in self.blocks):
                return False  # only whitespace, or a prefix of an at-start marker
        markers = [b.start for b in self.blocks if not b.at_start_only]
        found = find_first(s.buf, markers)
        if found is not None:
            i, marker = found
            self._text(s.buf[:i], out)
            block = next(b for b in self.blocks if b.start == marker and not b.at_start_only)
            self._open(block, "", s.buf[i:])
            return True
        keep = held_suffix(s.buf, markers)
        self._text(s.buf[:len(s.buf) - keep], out)
        s.buf = s.buf[len(s.buf) - keep:]
        return False

    def _open(self, block: Block, space: str, rest: str) -> None:
        s = self._s
        s.mode, s.block = "block", block
        s.block_prefix = space + ("" if block.keep_start else block.start)
        s.buf = rest if block.keep_start else rest[len(block.start):]
        s.at_beginning = False

    def _close_block(self, body: str, end: str, out: list[str], calls: list[ToolCall]) -> None:
        s = self._s
        assert s.block is not None
        found = self.parse_block(s.block, body)
        if found:
            s.pending_space, s.after_call = "", True
            calls.extend(found)
            s.calls.extend(found)
        else:
            self._text(s.block_prefix + body + end, out)
        s.mode, s.block, s.block_prefix = "text", None, ""

    def _text(self, text: str, out: list[str]) -> None:
        s = self._s
        if s.after_call:
            text = text.lstrip()
            if not text:
                return
            s.after_call = False
        core, space = split_trailing_space(s.pending_space + text)
        if core:
            out.append(core)
            s.at_beginning = False
        s.pending_space = space


# ---------------------------------------------------------------- helpers for formats


def arguments_json(args: Any) -> str | None:
    """Compact JSON text of a call's arguments object (a JSON string holding an object is accepted); None if
    the arguments are not an object."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def call_from_obj(obj: Any, tools: frozenset[str], args_keys: tuple[str, ...] = ("arguments", "parameters")
                  ) -> ToolCall | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}` naming one of `tools`, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tools:
        return None
    key = next((k for k in args_keys if k in obj), None)
    if set(obj) - {"name", *args_keys} - {"type", "id"}:
        return None
    args = arguments_json(obj[key]) if key is not None else "{}"
    return ToolCall(obj["name"], args) if args is not None else None


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """Every JSON value in `text`, separated by whitespace or the characters of `separators`; None unless the
    whole text is such a sequence (and holds at least one value)."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (out and text[i] in separators)):
            i += 1
        if i >= n:
            return out or None
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(obj)
