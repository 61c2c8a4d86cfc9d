"""Chat outputs split into reasoning, content and tool calls: the whole-output split, the SSE chunk sequence
(a fake handle yielding cumulative text, cut at every character), the reasoning plan's 400s, and the
constraints tool formats build (compiled by the real llguidance backend)."""

from __future__ import annotations

import asyncio
import json

import llguidance
import pytest

from runtime.config import GrammarConfig
from runtime.constrained.llguidance_backend import grammar_text
from runtime.messages import FinishStop
from runtime.tokenizer.generate_input import RequestError
from server.openai import tool_format as F
from server.openai import tools as T
from server.openai.chat_output import OutputPlan, split_output
from server.openai.reasoning import ReasoningPlan, plan_reasoning, thinking_params
from server.openai.streaming import ChatStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
STOP = FinishStop(matched=2)


class CumulativeHandle:
    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    async def __aiter__(self):
        text = ""
        for k, p in enumerate(self.pieces):
            text += p
            done = k == len(self.pieces) - 1
            yield {"index": 0, "text": text, "output_ids": [], "meta_info": {
                "finish_reason": STOP if done else None, "prompt_tokens": 1, "completion_tokens": 1}}


def _stream(output: OutputPlan, pieces: list[str]) -> tuple[str, str, list[dict], str]:
    stream = ChatStream(CumulativeHandle(pieces), {"id": "x"}, 1, output, None, 0, False, lambda m: {})

    async def run():
        return [ev async for ev in stream.events()]

    evs = asyncio.run(run())
    deltas = [e["choices"][0]["delta"] for e in evs[1:]]
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            calls.setdefault(c["index"], {"name": "", "arguments": ""})
            calls[c["index"]]["name"] += c.get("function", {}).get("name") or ""
            calls[c["index"]]["arguments"] += c.get("function", {}).get("arguments") or ""
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), [calls[k] for k in sorted(calls)],
            evs[-1]["choices"][0]["finish_reason"])


CASES = [
    ("qwen3", None, "none", "<think>\nThe user wants JSON.\n</think>\n\n{\"a\": 1}", "The user wants JSON.",
     '{"a": 1}', []),
    ("qwen3", "qwen25", "auto", '<think>\nNeed the weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": '
     '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "Need the weather.", "Checking.",
     [("get_weather", '{"city": "Oslo"}')]),
    ("deepseek-r1", "deepseekv3", "required", "Use the tool.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
     "function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Use the tool.", None,
     [("get_time", "{}")]),
    (None, "llama3", "auto", '{"name": "get_time", "parameters": {}}', None, None, [("get_time", "{}")]),
    ("qwen3", None, "auto", '<think>x</think>{"name": "get_weather", "arguments": {"city": "Rome"}}', "x", None,
     [("get_weather", '{"city": "Rome"}')]),
]


@pytest.mark.parametrize("reasoning,fmt,mode,text,want_r,want_c,want_calls", CASES)
def test_split_whole_and_streamed(reasoning, fmt, mode, text, want_r, want_c, want_calls):
    plan = T.parse_tools([WEATHER, TIME], mode) if mode != "none" else T.ToolPlan([], "none")
    output = OutputPlan(plan, ReasoningPlan(reasoning), fmt)
    whole = split_output(output, text)
    assert (whole.reasoning, whole.content) == (want_r, want_c)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
    assert got == want_calls
    for i in range(len(text) + 1):
        r, c, calls, reason = _stream(output, [text[:i], text[i:]])
        assert (r, c) == (want_r or "", want_c or ""), i
        assert [(k["name"], k["arguments"]) for k in calls] == want_calls
        assert reason == ("tool_calls" if want_calls else "stop")


def test_stream_reasoning_false_sends_reasoning_once():
    output = OutputPlan(T.ToolPlan([], "none"), ReasoningPlan("qwen3", stream=False), None)
    stream = ChatStream(CumulativeHandle(["<think>a", " b c", "</think>Hi", "!"]), {"id": "x"}, 1, output, None, 0,
                        False, lambda m: {})

    async def run():
        return [ev async for ev in stream.events()]

    deltas = [e["choices"][0]["delta"] for e in asyncio.run(run())[1:]]
    assert [d["reasoning_content"] for d in deltas if d.get("reasoning_content")] == ["a b c"]


def test_reasoning_plan():
    with pytest.raises(RequestError) as e:
        plan_reasoning({"thinking_budget": 10}, None, None)
    assert e.value.param == "thinking_budget" and "--reasoning-parser" in e.value.message and e.value.status == 400
    for fields in ({"separate_reasoning": False}, {"separate_reasoning": True, "stream_reasoning": True}):
        assert plan_reasoning(fields, None, None).parser is None  # SGLang's defaults: nothing to split
    assert plan_reasoning({}, "qwen3", {"enable_thinking": False}).parser is None
    p = plan_reasoning({"thinking_budget": 5, "separate_reasoning": False}, "qwen3", None)
    assert (p.parser, p.separate, p.budget, p.new_parser()) == ("qwen3", False, 5, None)
    assert thinking_params(p) == {"think_end": "</think>", "think_start": "<think>", "thinking_budget": 5}
    assert thinking_params(plan_reasoning({}, "deepseek-r1", None)) == {"think_end": "</think>"}
    with pytest.raises(RequestError):
        plan_reasoning({"thinking_budget": -1}, "qwen3", None)


def _compiles(cons: dict[str, str]) -> None:
    (kind, spec), = cons.items()
    text = grammar_text(kind, spec, GrammarConfig())
    assert not llguidance.LLMatcher.validate_grammar(text, None)


@pytest.mark.parametrize("fmt", ["qwen25", "llama3", "mistral", "deepseekv3", None])
def test_tool_constraints(fmt):
    required = T.parse_tools([WEATHER, TIME], "required")
    cons = F.constraint(required, fmt, True)
    if fmt is None:
        assert set(cons) == {"json_schema"}
    else:
        spec = json.loads(cons["structural_tag"])
        assert spec["only_tags"] and "max_tags" not in spec and len(spec["structures"]) == 2
        named = json.loads(F.constraint(T.parse_tools([WEATHER, TIME], {"type": "function", "function": {
            "name": "get_weather"}}), fmt, True)["structural_tag"])
        assert named["max_tags"] == 1 and [s["schema"] for s in named["structures"]] == [
            WEATHER["function"]["parameters"]]
    _compiles(cons)
    assert F.constraint(T.parse_tools([WEATHER, TIME], "auto"), fmt, True) is None
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    cons = F.constraint(T.parse_tools([strict, TIME], "auto"), fmt, True)
    spec = json.loads(cons["structural_tag"])
    assert "only_tags" not in spec and spec["structures"][0]["schema"] == WEATHER["function"]["parameters"]
    assert spec["structures"][1]["schema"] == F.ANY_OBJECT
    _compiles(cons)


def test_pythonic_cannot_be_constrained():
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    with pytest.raises(RequestError) as e:
        F.constraint(T.parse_tools([strict], "auto"), "pythonic", True)
    assert e.value.param == "tools[0].function.strict"
    with pytest.raises(RequestError) as e:
        F.constraint(T.parse_tools([WEATHER], "required"), "pythonic", True)
    assert e.value.param == "tool_choice"
    with pytest.raises(RequestError):
        T.parse_tools([{**WEATHER, "function": {**WEATHER["function"], "strict": "yes"}}], "auto")
