"""Output parsers for reasoning models and tool-calling models, by SGLang's names.

    p = create_reasoning_parser("qwen3")              # --reasoning-parser
    reasoning, content = p.parse(text)                 # a whole output
    p = create_reasoning_parser("qwen3")               # one parser per streamed output
    r_delta, c_delta = p.feed(delta); ...; p.finish()  # the deltas concatenate to parse(text)
    p.think_end                                        # the marker after which the answer begins

    t = create_tool_parser("qwen25", {"get_weather"})  # --tool-call-parser, the request's function names
    content, calls = t.parse(text)                     # calls: [ToolCall(name, arguments JSON text)]
    t.feed(delta) / t.finish()                         # same streaming contract

Pure text code: no server state, no I/O. `detect_tool_parser(chat_template)` names the format a chat template
speaks (None when it shows none).
"""

from __future__ import annotations

from server.parsers.deepseek import DeepSeekV3ToolParser
from server.parsers.gpt_oss import GptOssReasoningParser
from server.parsers.hermes import Qwen25ToolParser
from server.parsers.llama3 import Llama3ToolParser
from server.parsers.mistral import MistralToolParser
from server.parsers.pythonic import PythonicToolParser
from server.parsers.reasoning import THINK_FAMILIES, BaseReasoningParser, ReasoningResult
from server.parsers.tool_base import BaseToolParser, CallTemplate, ToolCall, ToolResult

REASONING_PARSERS: dict[str, type[BaseReasoningParser]] = {**THINK_FAMILIES, "gpt-oss": GptOssReasoningParser}
TOOL_PARSERS: dict[str, type[BaseToolParser]] = {
    "qwen25": Qwen25ToolParser, "hermes": Qwen25ToolParser, "llama3": Llama3ToolParser,
    "mistral": MistralToolParser, "pythonic": PythonicToolParser, "deepseekv3": DeepSeekV3ToolParser,
}
# A marker only one format's chat template writes -> that format (first match wins).
_TEMPLATE_MARKERS = (("<｜tool▁calls▁begin｜>", "deepseekv3"), ("[TOOL_CALLS]", "mistral"),
                     ("<|python_tag|>", "llama3"), ("<tool_call>", "qwen25"), ("<|python_start|>", "pythonic"))

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "BaseReasoningParser", "BaseToolParser", "CallTemplate",
           "ReasoningResult", "ToolCall", "ToolResult", "create_reasoning_parser", "create_tool_parser",
           "detect_tool_parser"]


def create_reasoning_parser(name: str) -> BaseReasoningParser:
    """A fresh reasoning parser; ValueError naming the known ones for an unknown name."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r} (one of {', '.join(REASONING_PARSERS)})")
    return cls()


def create_tool_parser(name: str, tools: frozenset[str] | set[str]) -> BaseToolParser:
    """A fresh tool-call parser for a request whose functions are `tools`."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r} (one of {', '.join(TOOL_PARSERS)})")
    return cls(frozenset(tools))


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template writes, by its markers; None when it shows none."""
    if not chat_template:
        return None
    return next((name for marker, name in _TEMPLATE_MARKERS if marker in chat_template), None)
