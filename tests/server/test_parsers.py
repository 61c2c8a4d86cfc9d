"""The reasoning and tool-call parsers on recorded outputs: the one-piece result is the expected split, and
every way of streaming the same output (cut at every character boundary, in two and in three pieces, and one
character at a time) concatenates to exactly that result. The detokenizer's deltas are whole characters."""

from __future__ import annotations

import pytest

from server.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ToolCall,
    create_reasoning_parser,
    create_tool_parser,
    detect_tool_parser,
)
from tests.server.parser_cases import REASONING, TOOLS, WEATHER


def _splits(text: str) -> list[list[str]]:
    n = len(text)
    out = [[text[:i], text[i:]] for i in range(n + 1)]
    out.append(list(text))
    step = max(1, n // 25)
    out += [[text[:i], text[i:j], text[j:]] for i in range(0, n + 1, step) for j in range(i, n + 1)]
    return out


def _stream_reasoning(name: str, pieces: list[str]) -> tuple[str, str]:
    p = create_reasoning_parser(name)
    r, c = [], []
    for piece in pieces:
        a = p.feed(piece)
        r.append(a.reasoning)
        c.append(a.content)
    a = p.finish()
    return "".join(r) + a.reasoning, "".join(c) + a.content


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_recorded(name: str, text: str, reasoning: str, content: str) -> None:
    assert tuple(create_reasoning_parser(name).parse(text)) == (reasoning, content)
    for pieces in _splits(text):
        assert _stream_reasoning(name, pieces) == (reasoning, content), pieces


def _stream_tools(name: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    p = create_tool_parser(name, WEATHER)
    content, calls = [], []
    for piece in pieces:
        a = p.feed(piece)
        content.append(a.content)
        calls += a.calls
    a = p.finish()
    return "".join(content) + a.content, calls + a.calls


@pytest.mark.parametrize("name,text,content,calls", TOOLS)
def test_tool_calls_recorded(name: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    want = (content, [ToolCall(*c) for c in calls])
    assert tuple(create_tool_parser(name, WEATHER).parse(text)) == want
    for pieces in _splits(text):
        assert _stream_tools(name, pieces) == want, pieces


def test_content_streams_before_the_call() -> None:
    """Answer text is emitted as soon as it cannot start a marker; the call arrives when its block closes."""
    p = create_tool_parser("qwen25", {"get_weather"})
    assert p.feed("Let me check. <tool").content == "Let me check."
    mid = p.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert mid.content == "" and mid.calls == []
    assert p.feed("\n</tool_call>").calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    r = create_reasoning_parser("qwen3")
    assert r.feed("<think>\nstep one, ").reasoning == "step one,"
    assert tuple(r.feed("step two</th")) == (" step two", "")
    assert tuple(r.feed("ink>\n\nDone")) == ("", "Done")


def test_thinking_switch() -> None:
    qwen3, v3 = create_reasoning_parser("qwen3"), create_reasoning_parser("deepseek-v3")
    assert qwen3.thinking_on(None) and qwen3.thinking_on({"enable_thinking": True})
    assert not qwen3.thinking_on({"enable_thinking": False})
    assert not v3.thinking_on({}) and v3.thinking_on({"thinking": True})
    assert create_reasoning_parser("deepseek-r1").thinking_on({"enable_thinking": False})


def test_registry_and_detection() -> None:
    assert {"deepseek-r1", "qwen3", "gpt-oss"} <= set(REASONING_PARSERS)
    assert {"qwen25", "llama3", "mistral", "pythonic", "deepseekv3"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="qwen3"):
        create_reasoning_parser("nope")
    with pytest.raises(ValueError, match="qwen25"):
        create_tool_parser("nope", set())
    assert detect_tool_parser("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "qwen25"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3"
    assert detect_tool_parser("[TOOL_CALLS] {{ calls }}") == "mistral"
    assert detect_tool_parser("{{'<｜tool▁calls▁begin｜>'}}") == "deepseekv3"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None


@pytest.mark.parametrize("name", ["qwen25", "llama3", "mistral", "deepseekv3"])
def test_call_template_round_trips(name: str) -> None:
    """A call spelled by the format's own template (what a constrained request generates) parses back."""
    p = create_tool_parser(name, {"get_weather"})
    t = p.call_template("get_weather")
    text = t.begin + '{"city": "Paris"}' + t.end
    assert p.parse(text) == ("", [ToolCall("get_weather", '{"city": "Paris"}')])
    assert text.startswith(t.trigger)


@pytest.mark.parametrize("name", ["qwen25", "llama3", "mistral", "deepseekv3"])
def test_constrained_calls_parse_back(name: str) -> None:
    """Several calls spelled as a required tool_choice constrains them (templates joined by the format's
    separator) parse back to those calls."""
    p = create_tool_parser(name, {"get_weather", "get_time"})
    a, b = p.call_template("get_weather"), p.call_template("get_time")
    text = a.begin + '{"city": "Paris"}' + a.end + p.call_separator() + b.begin + "{}" + b.end
    assert p.parse(text) == ("", [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")])
