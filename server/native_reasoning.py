"""Reasoning on SGLang's native API: `separate_reasoning` in a /generate body, and POST /separate_reasoning.

/generate with `"separate_reasoning": true` (needs --reasoning-parser; a 400 naming it otherwise): the request
thinks (its constraint applies after the end-of-thinking marker, `thinking_budget` in sampling_params bounds
it) and each result's `text` is the answer, `reasoning_text` the thinking. Streamed results stay cumulative,
as /generate's are: the split is made by one incremental parser per sample, so a chunk's texts only grow.
A body-level `reasoning_parser` makes the request think in that parser's format without splitting its text.
/separate_reasoning `{"text", "reasoning_parser"?}` -> `{"text", "reasoning_text"}` splits a finished text
(SGLang's route; the parser defaults to the server's).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.generate_input import RequestError
from server.errors import no_reasoning_parser, read_json
from server.http import JSON, get_state
from server.parsers import REASONING_PARSERS, BaseReasoningParser, create_reasoning_parser

router = APIRouter()


def reasoning_of(body: Any, server_parser: str | None) -> str | None:
    """The parser name when the body asks for separate_reasoning (400 without a server parser), else None.
    The thinking sampling params (constraint after the thinking) go into every prompt's sampling_params, for
    separate_reasoning and for a body-level `reasoning_parser` (a parser name: the request thinks in that
    format, its text is returned whole; what frontend_lang's separate_reasoning sends)."""
    if not isinstance(body, dict):
        return None
    named = body.get("reasoning_parser")
    if named is not None and named not in REASONING_PARSERS:
        raise RequestError(f"unknown reasoning_parser {named!r}"[:200] + f" (one of {', '.join(REASONING_PARSERS)})",
                           "reasoning_parser", "invalid_value")
    separate = body.get("separate_reasoning")
    if separate not in (None, True, False):
        raise RequestError("'separate_reasoning' must be a boolean", "separate_reasoning", "invalid_type")
    if separate and server_parser is None:
        raise no_reasoning_parser("separate_reasoning")
    name = server_parser if separate else named
    if name is None:
        return None
    _add_thinking(body, create_reasoning_parser(name).sampling_params())
    return server_parser if separate else None


def _add_thinking(body: dict, extra: dict[str, Any]) -> None:
    sps = body.get("sampling_params")
    for sp in sps if isinstance(sps, list) else [sps]:
        if isinstance(sp, dict):
            for k, v in extra.items():
                sp.setdefault(k, v)
    if sps is None:
        body["sampling_params"] = dict(extra)


class CumulativeSplit:
    """Per-sample incremental split of cumulative /generate results."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.parsers: dict[int, BaseReasoningParser] = {}
        self.seen: dict[int, int] = {}
        self.acc: dict[int, list[str]] = {}

    def apply(self, item: dict[str, Any]) -> dict[str, Any]:
        i = item.get("index", 0)
        p = self.parsers.setdefault(i, create_reasoning_parser(self.name))
        acc = self.acc.setdefault(i, ["", ""])
        text = item["text"]
        a = p.feed(text[self.seen.get(i, 0):])
        self.seen[i] = len(text)
        acc[0] += a.reasoning
        acc[1] += a.content
        if item["meta_info"].get("finish_reason") is not None:
            b = p.finish()
            acc[0] += b.reasoning
            acc[1] += b.content
        return {**item, "text": acc[1], "reasoning_text": acc[0]}


def split_final(name: str, item: dict[str, Any]) -> dict[str, Any]:
    reasoning, content = create_reasoning_parser(name).parse(item["text"])
    return {**item, "text": content, "reasoning_text": reasoning}


@router.post("/separate_reasoning")
async def separate_reasoning(request: Request) -> Response:
    state = get_state(request)
    body = await read_json(request, state.cfg.server.max_body_bytes)
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise RequestError("'text' (a string) is required", "text", "missing_required_parameter")
    name = body.get("reasoning_parser") or state.cfg.server.reasoning_parser
    if name is None:
        raise no_reasoning_parser("reasoning_parser")
    if name not in REASONING_PARSERS:
        raise RequestError(f"unknown reasoning parser {name!r}"[:200] + f" (one of {', '.join(REASONING_PARSERS)})",
                           "reasoning_parser", "invalid_value")
    reasoning, content = create_reasoning_parser(name).parse(body["text"])
    return JSON({"text": content, "reasoning_text": reasoning})
