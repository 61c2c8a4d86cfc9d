"""Reasoning parsers: split a reasoning model's output into its thinking and its answer.

Families (SGLang's `--reasoning-parser` names, markers from each model's chat template):
- deepseek-r1, qwen3-thinking, step3: the template opens `<think>` in the prompt, so the output starts inside the
  thinking (an opening `<think>` the model writes anyway is dropped) and `</think>` ends it.
- qwen3, glm45: the model opens `<think>` itself; output that does not begin with it is all answer.
- kimi: as qwen3 with `◁think▷` / `◁/think▷`.
- deepseek-v3: as deepseek-r1, only when the request sets chat_template_kwargs `thinking: true`.

Result rules (the same for `parse` and the concatenated deltas of `feed` + `finish`, whatever the split):
- the reasoning is the text between the markers with surrounding whitespace removed;
- the answer after `</think>` loses its leading whitespace; output with no thinking is the answer unchanged;
- output cut before `</think>` (max tokens, thinking budget) is all reasoning and an empty answer.
The opening marker counts only at the very start of the output (after whitespace): a `<think>` mentioned
later in an answer stays text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from server.parsers.markers import held_suffix, split_trailing_space


class ReasoningResult(NamedTuple):
    reasoning: str  # "" when there was none
    content: str


@dataclass(frozen=True)
class ThinkFormat:
    """One family's markers and defaults."""

    start: str
    end: str
    starts_in_reasoning: bool  # the template opened the thinking block in the prompt
    switch: str | None = None  # chat_template_kwargs key that turns thinking on or off
    switch_default: bool = True  # thinking when the request does not set `switch`
    special_tokens: bool = False  # markers are special tokens (decode with skip_special_tokens off)


class BaseReasoningParser:
    """Incremental splitter. `feed(delta)` returns the reasoning and answer text that is now final; `finish()`
    returns what was held back. `parse(text)` is feed + finish on a fresh parser."""

    name = ""
    fmt: ThinkFormat

    def fresh(self) -> BaseReasoningParser:
        return type(self)()

    @property
    def think_end(self) -> str:
        """The text after which the answer (and any grammar on it) begins."""
        return self.fmt.end

    @property
    def special_tokens(self) -> bool:
        return self.fmt.special_tokens

    def thinking_on(self, template_kwargs: dict | None) -> bool:
        """Whether a request with these chat_template_kwargs thinks (otherwise nothing is separated)."""
        if self.fmt.switch is None:
            return True
        v = (template_kwargs or {}).get(self.fmt.switch)
        return self.fmt.switch_default if v is None else bool(v)

    def starts_in_reasoning(self) -> bool:
        return self.fmt.starts_in_reasoning

    def sampling_params(self, budget: int | None = None) -> dict[str, object]:
        """The runtime's sampling params for a thinking request: its constraint applies after `think_end`
        (`think_start`: the model may open the thinking or answer at once), at most `budget` thinking tokens,
        special-token markers kept in the text."""
        out: dict[str, object] = {"think_end": self.think_end}
        if not self.fmt.starts_in_reasoning:
            out["think_start"] = self.fmt.start
        if budget is not None:
            out["thinking_budget"] = budget
        if self.fmt.special_tokens:
            out["skip_special_tokens"] = False
        return out

    def feed(self, delta: str) -> ReasoningResult:
        raise NotImplementedError

    def finish(self) -> ReasoningResult:
        raise NotImplementedError

    def parse(self, text: str) -> ReasoningResult:
        p = self.fresh()
        a, b = p.feed(text), p.finish()
        return ReasoningResult(a.reasoning + b.reasoning, a.content + b.content)


class ThinkReasoningParser(BaseReasoningParser):
    """`<think>...</think>` families. States: undecided (only whitespace or part of the opening marker seen),
    reasoning, answer (after the closing marker), plain (no thinking: everything is answer, verbatim)."""

    def __init__(self) -> None:
        self._state = "undecided"
        self._buf = ""  # held back: undecided prefix, partial marker, trailing reasoning whitespace
        self._started = False  # some reasoning (or answer, in state answer) was emitted

    def feed(self, delta: str) -> ReasoningResult:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == "undecided":
                if not self._decide():
                    break
            elif self._state == "reasoning":
                if not self._reasoning(reasoning):
                    break
            else:
                content.append(self._answer())
                break
        return ReasoningResult("".join(reasoning), "".join(content))

    def _decide(self) -> bool:
        s = self._buf.lstrip()
        start = self.fmt.start
        if s.startswith(start):
            self._buf, self._state = s[len(start):], "reasoning"
            return True
        if start.startswith(s):  # empty, or a prefix of the opening marker: wait
            return False
        self._state = "reasoning" if self.fmt.starts_in_reasoning else "plain"
        return True

    def _reasoning(self, out: list[str]) -> bool:
        """Emit final reasoning text; True when the closing marker was passed (state is now answer)."""
        if not self._started:
            self._buf = self._buf.lstrip()
        i = self._buf.find(self.fmt.end)
        if i >= 0:
            out.append(self._buf[:i].rstrip())
            self._buf, self._state, self._started = self._buf[i + len(self.fmt.end):], "answer", False
            return True
        keep = held_suffix(self._buf, [self.fmt.end])
        core, space = split_trailing_space(self._buf[:len(self._buf) - keep])
        if core:
            out.append(core)
            self._started = True
        self._buf = space + self._buf[len(self._buf) - keep:]
        return False

    def _answer(self) -> str:
        if self._state == "answer" and not self._started:
            self._buf = self._buf.lstrip()
            self._started = bool(self._buf)
        out, self._buf = self._buf, ""
        return out

    def finish(self) -> ReasoningResult:
        buf, self._buf = self._buf, ""
        if self._state == "undecided":  # only whitespace or a cut-off opening marker came
            if self.fmt.starts_in_reasoning:
                return ReasoningResult(buf.strip(), "")
            return ReasoningResult("", buf)
        if self._state == "reasoning":
            return ReasoningResult((buf if self._started else buf.lstrip()).rstrip(), "")
        return ReasoningResult("", buf)


def _family(name: str, fmt: ThinkFormat) -> type[ThinkReasoningParser]:
    return type(f"ReasoningParser_{name.replace('-', '_')}", (ThinkReasoningParser,), {"name": name, "fmt": fmt})


THINK = ThinkFormat("<think>", "</think>", starts_in_reasoning=False)
FORCED = ThinkFormat("<think>", "</think>", starts_in_reasoning=True)

THINK_FAMILIES: dict[str, type[BaseReasoningParser]] = {
    "deepseek-r1": _family("deepseek-r1", FORCED),
    "qwen3": _family("qwen3", ThinkFormat("<think>", "</think>", False, switch="enable_thinking")),
    "qwen3-thinking": _family("qwen3-thinking", FORCED),
    "glm45": _family("glm45", ThinkFormat("<think>", "</think>", False, switch="enable_thinking")),
    "step3": _family("step3", FORCED),
    "kimi": _family("kimi", ThinkFormat("◁think▷", "◁/think▷", starts_in_reasoning=False)),
    "deepseek-v3": _family("deepseek-v3", ThinkFormat("<think>", "</think>", True, switch="thinking",
                                                      switch_default=False)),
}
