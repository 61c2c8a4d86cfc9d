"""Whether a chat or Responses request thinks and how its reasoning is returned.

A request thinks when the server has `--reasoning-parser` and the parser's chat_template_kwargs switch (qwen3's
`enable_thinking`, deepseek-v3's `thinking`) does not turn it off. A thinking request's constraint applies only
after the end-of-thinking marker (`thinking_params`), and with `separate_reasoning` (default true) its
output is split into `reasoning_content` and `content`. `stream_reasoning: false` sends the reasoning as one
delta instead of as it is generated. `thinking_budget` bounds the thinking in tokens: at the budget the
end-of-thinking marker is forced and the answer begins.

On a server without a reasoning parser, `thinking_budget` is a 400 naming `--reasoning-parser` (a silent drop
would leave the thinking unbounded); `separate_reasoning` and `stream_reasoning` are SGLang's fields at their
defaults (true), which SGLang's clients and sglang-router send with every chat request: there they split nothing,
as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.tokenizer.generate_input import RequestError
from server.errors import no_reasoning_parser
from server.parsers import BaseReasoningParser, create_reasoning_parser

ASKS = ("thinking_budget",)  # what a request without a reasoning parser cannot have


@dataclass(frozen=True)
class ReasoningPlan:
    parser: str | None  # the reasoning parser's name when this request thinks, else None
    separate: bool = True
    stream: bool = True
    budget: int | None = None

    def new_parser(self) -> BaseReasoningParser | None:
        """A parser for one output (None: the output is left whole)."""
        return create_reasoning_parser(self.parser) if self.parser and self.separate else None


def plan_reasoning(data: dict[str, Any], server_parser: str | None, template_kwargs: dict | None
                   ) -> ReasoningPlan:
    """The plan for a request body (`data`: its JSON object)."""
    for key, kind in (("separate_reasoning", bool), ("stream_reasoning", bool), ("thinking_budget", int)):
        v = data.get(key)
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise RequestError(f"'{key}' must be {'a boolean' if kind is bool else 'an integer'}", key,
                               "invalid_type")
    budget = data.get("thinking_budget")
    if budget is not None and budget < 0:
        raise RequestError("'thinking_budget' must be at least 0", "thinking_budget", "integer_below_min_value")
    if server_parser is None:
        asked = next((k for k in ASKS if data.get(k) not in (None, False)), None)
        if asked is not None:
            raise no_reasoning_parser(asked)
        return ReasoningPlan(None)
    if not create_reasoning_parser(server_parser).thinking_on(template_kwargs):
        return ReasoningPlan(None)
    return ReasoningPlan(server_parser, data.get("separate_reasoning") is not False,
                         data.get("stream_reasoning") is not False, budget)


def thinking_params(plan: ReasoningPlan) -> dict[str, Any]:
    """Sampling-params entries that make the runtime apply a constraint only after the thinking."""
    if plan.parser is None:
        return {}
    return create_reasoning_parser(plan.parser).sampling_params(plan.budget)
