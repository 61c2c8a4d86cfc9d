"""One chat output split into reasoning, answer and tool calls: whole (`split_output`) or streamed
(`OutputSplitter`), through the same parsers, so a stream's deltas concatenate to the whole result.

Order: the reasoning parser (when the request thinks and separates reasoning) takes the raw text first; the
answer part goes to the tool-call format's parser (server/openai/tool_format.py) when the request has tools
and the server a format, else to radixgen's generic tool reading (server/openai/tools.py `calls_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from server.openai import tool_format as F
from server.openai import tools as T
from server.openai.reasoning import ReasoningPlan
from server.parsers import BaseReasoningParser, BaseToolParser


@dataclass(frozen=True)
class OutputPlan:
    tools: T.ToolPlan
    reasoning: ReasoningPlan
    tool_format: str | None  # the format's parser name; None: generic
    parallel: bool = True

    def tool_parser(self) -> BaseToolParser | None:
        return F.request_parser(self.tool_format, self.tools)


class Output(NamedTuple):
    reasoning: str | None  # None: no reasoning (none generated, or not separated)
    content: str | None
    calls: list[dict[str, Any]]  # OpenAI tool_calls entries


def _api_calls(parsed: list, parallel: bool) -> list[dict[str, Any]]:
    calls = [T.tool_call(c.name, c.arguments) for c in parsed]
    return calls if parallel else calls[:1]


def split_output(plan: OutputPlan, text: str) -> Output:
    rp = plan.reasoning.new_parser()
    reasoning, content = rp.parse(text) if rp is not None else ("", text)
    tp = plan.tool_parser()
    if tp is not None:
        res = tp.parse(content)
        calls = _api_calls(res.calls, plan.parallel)
        return Output(reasoning or None, res.content or (None if calls else res.content), calls)
    body, calls = T.calls_of(plan.tools, content, plan.parallel)
    return Output(reasoning or None, body, calls)


@dataclass
class OutputSplitter:
    """Streamed counterpart of `split_output` for one choice. `feed(new_text, done)` returns
    (reasoning delta, answer text so far, new tool calls): the answer so far is cumulative because the generic
    tool reading (server/openai/streaming.py) decides on the whole text; with a format, calls come from the
    format's parser and the answer is already free of them."""

    plan: OutputPlan
    rp: BaseReasoningParser | None = None
    tp: BaseToolParser | None = None
    answer: str = ""
    held_reasoning: str = ""  # stream_reasoning false: reasoning kept until the answer starts or the end
    n_calls: int = 0

    def __post_init__(self) -> None:
        self.rp = self.plan.reasoning.new_parser()
        self.tp = self.plan.tool_parser()

    def feed(self, new: str, done: bool) -> tuple[str, str, list[dict[str, Any]]]:
        if self.rp is not None:
            a = self.rp.feed(new)
            r, c = a.reasoning, a.content
            if done:
                b = self.rp.finish()
                r, c = r + b.reasoning, c + b.content
        else:
            r, c = "", new
        calls: list[dict[str, Any]] = []
        if self.tp is not None:
            res = self.tp.feed(c)
            c, found = res.content, list(res.calls)
            if done:
                end = self.tp.finish()
                c, found = c + end.content, found + list(end.calls)
            if not self.plan.parallel:
                found = found[:max(0, 1 - self.n_calls)]
            calls = _api_calls(found, True)
            self.n_calls += len(calls)
        self.answer += c
        if not self.plan.reasoning.stream:
            self.held_reasoning += r
            r = ""
            if self.held_reasoning and (self.answer or calls or done):
                r, self.held_reasoning = self.held_reasoning, ""
        return r, self.answer, calls
