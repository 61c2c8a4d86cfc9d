"""gpt-oss (harmony format) reasoning parser: channels instead of think tags.

The chat template ends the prompt with `<|start|>assistant`, so an output is a sequence of messages
`<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY<|end|>`, later ones opened again by
`<|start|>assistant`, the last ending `<|return|>` (or `<|call|>` for a tool call, or nothing when cut).
Routing: `analysis` bodies are reasoning; `final` bodies and `commentary` bodies without a recipient are the
answer; a message with a recipient (`to=functions.x`, a tool call) is kept verbatim in the answer, markers and
all, for a tool-call parser to read. Output that does not open with a channel is all answer, verbatim.
The markers are special tokens: requests decode with skip_special_tokens off under this parser.
"""

from __future__ import annotations

from server.parsers.markers import find_first, held_suffix
from server.parsers.reasoning import BaseReasoningParser, ReasoningResult, ThinkFormat

CHANNEL, START, MESSAGE = "<|channel|>", "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
FINAL = "<|channel|>final<|message|>"


class GptOssReasoningParser(BaseReasoningParser):
    name = "gpt-oss"
    fmt = ThinkFormat(CHANNEL + "analysis" + MESSAGE, FINAL, starts_in_reasoning=False, special_tokens=True)

    def __init__(self) -> None:
        self._state = "undecided"  # undecided | header | body | plain
        self._buf = ""
        self._header = ""  # the current message's header text (between messages)
        self._route = "content"  # the current body's destination: reasoning | content | verbatim

    def feed(self, delta: str) -> ReasoningResult:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return ReasoningResult("".join(reasoning), "".join(content))

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Advance one state; False when the buffer holds nothing decidable."""
        if self._state == "undecided":
            s = self._buf.lstrip()
            if s.startswith(CHANNEL) or s.startswith(START):
                self._buf, self._state = s, "header"
                return True
            if CHANNEL.startswith(s) or START.startswith(s):
                return False
            self._state = "plain"
            return True
        if self._state == "plain":
            content.append(self._buf)
            self._buf = ""
            return False
        if self._state == "header":
            i = self._buf.find(MESSAGE)
            if i < 0:
                return False
            self._header = self._buf[:i]
            self._buf, self._state = self._buf[i + len(MESSAGE):], "body"
            self._route = _route_of(self._header)
            if self._route == "verbatim":
                content.append(self._header + MESSAGE)
            return True
        found = find_first(self._buf, ENDS)
        if found is None:
            keep = held_suffix(self._buf, ENDS)
            self._emit(self._buf[:len(self._buf) - keep], reasoning, content)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        i, end = found
        self._emit(self._buf[:i], reasoning, content)
        if self._route == "verbatim":
            content.append(end)
        self._buf, self._state = self._buf[i + len(end):], "header"
        return True

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        (reasoning if self._route == "reasoning" else content).append(text)

    def finish(self) -> ReasoningResult:
        buf, self._buf = self._buf, ""
        if self._state in ("undecided", "plain"):
            return ReasoningResult("", buf)
        if self._state == "header":  # a cut-off header carries no text
            return ReasoningResult("", "")
        return ReasoningResult(buf, "") if self._route == "reasoning" else ReasoningResult("", buf)


def _route_of(header: str) -> str:
    """reasoning | content | verbatim for a message header such as `<|start|>assistant<|channel|>analysis`."""
    if " to=" in header or header.startswith("to=") or "<|constrain|>" in header:
        return "verbatim"
    channel = header.rsplit(CHANNEL, 1)[-1].split(" ")[0].strip() if CHANNEL in header else ""
    return "reasoning" if channel == "analysis" else "content"
