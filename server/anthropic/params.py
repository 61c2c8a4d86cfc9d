"""The Messages API's top-level parameters: which are known, which are refused, and the mapping onto
radixgen's sampling params (through the OpenAI routes' validators, server/openai/params.py).

Served: `model`, `messages`, `system`, `max_tokens` (required), `temperature` [0, 1], `top_p` (0, 1], `top_k`
(0: off), `stop_sequences`, `metadata` (`user_id` checked, then unused), `stream`, `tools`, `tool_choice`,
`service_tier`, `cache_control` (the radix cache reuses prefixes by itself) and `output_config.format`
(`{"type": "json_schema", "schema"}`: a JSON-schema constraint). `thinking` (enabled or adaptive, with
`budget_tokens`) needs the server's reasoning parser (`--reasoning-parser`; `thinking_plan`). Any other parameter, and those
asking for what radixgen does not do (`container`, `mcp_servers`, `context_management`, an effort level), is
a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ServerConfig
from runtime.tokenizer.generate_input import RequestError
from server.errors import no_reasoning_parser
from server.openai import params as P
from server.openai.reasoning import ReasoningPlan

KNOWN = frozenset({
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "metadata",
    "stream", "tools", "tool_choice", "thinking", "service_tier", "output_config", "cache_control",
    "container", "mcp_servers", "context_management", "inference_geo", "speed", "diagnostics",
})
# What count_tokens takes (Anthropic's count_tokens has no max_tokens, sampling or stream).
COUNT_KNOWN = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                         "cache_control", "mcp_servers", "context_management"})
_THINKING = ("enabled", "disabled", "adaptive")


def body(data: Any, known: frozenset[str]) -> P.Body:
    """A `Body` over `data`, refusing parameters outside `known` and those asking for unserved features."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise RequestError(f"unsupported parameter(s): {', '.join(unknown)}"[:300], unknown[0],
                           "unsupported_parameter")
    for key in ("container", "mcp_servers", "context_management", "diagnostics"):
        if data.get(key):
            raise RequestError(f"'{key}' is not supported by this server", key, "unsupported_parameter")
    if data.get("inference_geo") is not None:
        raise RequestError("'inference_geo' is not supported by this server", "inference_geo", "unsupported_parameter")
    if data.get("speed") not in (None, "standard"):
        raise RequestError("'speed': only standard is served", "speed", "unsupported_parameter")
    tier = data.get("service_tier")
    if tier not in (None, "auto", "standard_only"):
        raise RequestError(f"'service_tier' must be auto or standard_only; got {tier!r}"[:200], "service_tier")
    _check_metadata(data.get("metadata"))
    check_thinking(data.get("thinking"))
    return P.Body(data, known)


def _check_metadata(v: Any) -> None:
    if v is None:
        return
    if not isinstance(v, dict):
        raise RequestError("'metadata' must be an object", "metadata", "invalid_type")
    extra = sorted(set(v) - {"user_id"})
    if extra:
        raise RequestError(f"'metadata.{extra[0]}': metadata takes only user_id", f"metadata.{extra[0]}",
                           "unsupported_parameter")
    if v.get("user_id") is not None and not isinstance(v["user_id"], str):
        raise RequestError("'metadata.user_id' must be a string", "metadata.user_id", "invalid_type")


def check_thinking(v: Any) -> None:
    """`thinking`: {"type": enabled | adaptive | disabled, "budget_tokens": a positive integer (enabled)}."""
    if v is None:
        return
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in _THINKING:
        raise RequestError(f"'thinking.type' must be one of {', '.join(_THINKING)}; got {kind!r}"[:200],
                           "thinking.type")
    budget = v.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise RequestError("'thinking.budget_tokens' must be a positive integer", "thinking.budget_tokens",
                           "invalid_value")


def thinking_plan(v: Any, server_parser: str | None) -> ReasoningPlan:
    """How a (checked) `thinking` request thinks: enabled or adaptive splits the reasoning out with the server's
    reasoning parser into thinking blocks, `budget_tokens` bounding it; without a parser that is a 400 naming
    --reasoning-parser (the thinking would come back inside the answer)."""
    if v is None or v.get("type") == "disabled":
        return ReasoningPlan(None)
    if server_parser is None:
        raise no_reasoning_parser("thinking")
    return ReasoningPlan(server_parser, budget=v.get("budget_tokens"))


def output_schema(b: P.Body) -> str | None:
    """The json_schema constraint text of `output_config.format` (None without one)."""
    cfg = b.raw("output_config")
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise RequestError("'output_config' must be an object", "output_config", "invalid_type")
    extra = sorted(set(cfg) - {"format", "effort"})
    if extra:
        raise RequestError(f"'output_config.{extra[0]}' is not supported", f"output_config.{extra[0]}",
                           "unsupported_parameter")
    if cfg.get("effort") is not None:
        raise RequestError("'output_config.effort': this model has no effort levels", "output_config.effort",
                           "unsupported_parameter")
    fmt = cfg.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise RequestError("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                           "output_config.format.type")
    if fmt.get("schema") is None:
        raise RequestError("'output_config.format.schema' is required", "output_config.format.schema",
                           "missing_required_parameter")
    return P.check_schema(fmt["schema"], "output_config.format.schema")


def max_tokens(b: P.Body) -> int:
    v = b.integer("max_tokens", 1)
    if v is None:
        raise RequestError("'max_tokens' is required", "max_tokens", "missing_required_parameter")
    return v


def sampling_params(b: P.Body, srv: ServerConfig) -> tuple[dict[str, Any], list[str]]:
    """(sampling params without max tokens and constraint, the stop sequences)."""
    sp: dict[str, Any] = {}
    temperature = b.number("temperature", 0.0, 1.0)
    if temperature is not None:
        sp["temperature"] = temperature
    top_p = b.number("top_p", 0.0, 1.0, lo_open=True)
    if top_p is not None:
        sp["top_p"] = top_p
    top_k = b.integer("top_k", 0)
    if top_k is not None:
        sp["top_k"] = top_k or -1
    stops = P.stop_strings(b.raw("stop_sequences"), srv, "stop_sequences")
    if stops:
        sp["stop"] = stops
    return sp, stops
