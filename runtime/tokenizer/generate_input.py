"""Native generate input: the `/generate` JSON body (or `Engine.generate` arguments) normalized to one
`GenerateRequest` per prompt, with type errors reported as `RequestError` naming the parameter.

Shapes accepted (SGLang's GenerateReqInput): `text` str | list[str], or `input_ids` list[int] |
list[list[int]]; `sampling_params` dict | list[dict] | null; `rid` str | list[str]; `stream` bool;
`return_logprob`, `logprob_start_len`, `top_logprobs_num` a scalar or one per prompt;
`return_text_in_logprobs` bool; `priority` an integer (with --enable-priority-scheduling). `null` anywhere means
the default. Top-level keys are the three lists below (GENERATE_KEYS served, GENERATE_INFORMATIONAL accepted,
UNSUPPORTED_GENERATE_KEYS only when not asked for); any other key is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RequestError(ValueError):
    """A request the server refuses: rendered as the OpenAI error envelope with `status`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
        self.type, self.headers = type, headers or {}


@dataclass(frozen=True)
class OpenAINames:
    """How an OpenAI route names a request's parameters in the errors the TokenizerManager raises for it."""

    prompt: str  # "prompt", "prompt[i]" or "messages"
    max_tokens: str  # "max_tokens" or "max_completion_tokens"
    constraint: str | None = None  # where the constraint came from: "response_format", "regex", "tools", ...
    default_max_tokens: int | None = None  # without max tokens: at most this many (None: all the room left)


@dataclass
class GenerateRequest:
    """One prompt's request as the TokenizerManager takes it (sampling params still a raw dict). The
    TokenizerManager validates it once (runtime/tokenizer/manager.py `_validate`); `openai` set by the
    OpenAI routes words the errors with their parameter names."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    openai: OpenAINames | None = None
    priority: int | None = None  # --enable-priority-scheduling: larger runs first (runtime/scheduler/policy.py)
    prediction: str | None = None  # OpenAI predicted output: the n-gram proposer's draft source


def is_int(x: Any) -> bool:
    """A JSON integer (bool is an int subclass in Python, never one in JSON)."""
    return isinstance(x, int) and not isinstance(x, bool)


def fit_context(context_len: int, prompt_len: int, requested: int | None, default: int | None,
                names: OpenAINames | None) -> int:
    """The one context-length check: max_new_tokens to send, `requested` (which must fit) or the default
    clamped to the room left (`default` None: all of it). Native or OpenAI wording by `names`."""
    room = context_len - prompt_len
    if names is None:
        if room <= 0 or (requested is not None and requested > room):
            want = requested if requested is not None else default
            assert want is not None  # native requests always carry a default (SamplingParams.max_new_tokens)
            raise RequestError(
                f"This model's maximum context length is {context_len} tokens. However, you requested "
                f"{prompt_len + want} tokens ({prompt_len} in the prompt, {want} for the completion).",
                "sampling_params.max_new_tokens", "context_length_exceeded")
    elif room <= 0:
        raise RequestError(f"This model's maximum context length is {context_len} tokens. However, your "
                           f"{names.prompt} resulted in {prompt_len} tokens. Please reduce the length of the "
                           f"{names.prompt}.", names.prompt, "context_length_exceeded")
    elif requested is not None and requested > room:
        raise RequestError(f"This model's maximum context length is {context_len} tokens. However, you requested "
                           f"{prompt_len + requested} tokens ({prompt_len} in the {names.prompt}, {requested} in the "
                           f"completion). Please reduce the length of the {names.prompt} or completion.",
                           names.max_tokens, "context_length_exceeded")
    if requested is not None:
        return requested
    return room if default is None else min(default, room)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be a boolean", key, "invalid_type")
    return v


def _per_item(body: dict, key: str, n: int, default: Any, check: Any) -> list[Any]:
    """A scalar (same for all prompts) or a list with one value per prompt."""
    v = body.get(key)
    if v is None:
        return [default] * n
    vals = v if isinstance(v, list) else [v] * n
    if len(vals) != n:
        raise RequestError(f"{key} has {len(vals)} entries for {n} prompts", key)
    out = []
    for x in vals:
        if x is None:
            out.append(default)
        elif not check(x):
            raise RequestError(f"{key} has the wrong type", key, "invalid_type")
        else:
            out.append(x)
    return out


def _prompts(body: dict) -> tuple[list[str | None], list[list[int] | None], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise RequestError("give either text or input_ids, not both", "text")
    if text is not None:
        if isinstance(text, str):
            return [text], [None], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), [None] * len(text), True
        raise RequestError("text must be a string or a non-empty list of strings", "text", "invalid_type")
    if ids is not None:
        if isinstance(ids, list) and ids and all(is_int(t) for t in ids):
            return [None], [list(ids)], False
        if (isinstance(ids, list) and ids and all(isinstance(r, list) for r in ids)
                and all(is_int(t) for r in ids for t in r)):
            return [None] * len(ids), [list(r) for r in ids], True
        raise RequestError("input_ids must be a non-empty list of token ids or a list of such lists",
                           "input_ids", "invalid_type")
    raise RequestError("either text or input_ids is required", "text", "missing_required_parameter")


# The /generate keys radixgen serves (SGLang's GenerateReqInput names).
GENERATE_KEYS = frozenset({"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
                           "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "priority",
                           # read by the route before this (server/native_reasoning.py)
                           "separate_reasoning", "reasoning_parser"})
# SGLang fields that only label or log a request (sglang-router fills them in on every /generate): accepted.
GENERATE_INFORMATIONAL = frozenset({"model", "log_metrics", "no_logs"})
# SGLang /generate keys that change what a request means and that radixgen does not serve: refused (400 naming
# the key) rather than dropped, so no client gets a text-only, base-model, logits-unprocessed answer unawares.
# null / false / "" / [] mean "not asked" and pass (sglang-router sends several of them as false).
UNSUPPORTED_GENERATE_KEYS = {
    "image_data": "image inputs are not supported (text-only models)",
    "lora_path": "LoRA adapters are not supported",
    "return_hidden_states": "returning hidden states is not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "background": "background requests are not supported",
    "return_bytes": "returning output bytes is not supported",
    "return_entropy": "returning entropies is not supported",
}


def refuse_unsupported(body: dict) -> None:
    unknown = sorted(k for k in body if k not in GENERATE_KEYS and k not in GENERATE_INFORMATIONAL
                     and k not in UNSUPPORTED_GENERATE_KEYS)
    if unknown:
        raise RequestError(f"unsupported parameter(s): {', '.join(unknown)}"[:300], unknown[0],
                           "unsupported_parameter")
    for key, why in UNSUPPORTED_GENERATE_KEYS.items():
        value = body.get(key)
        if value is not None and value is not False and value != "" and value != []:
            raise RequestError(f"'{key}': {why}", key, "unsupported_parameter")


def normalize_generate(body: Any) -> tuple[list[GenerateRequest], bool]:
    """Split a generate body into per-prompt requests; returns (requests, is_batch)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_type")
    refuse_unsupported(body)
    texts, ids, is_batch = _prompts(body)
    n = len(texts)
    sps = body.get("sampling_params")
    if sps is None or isinstance(sps, dict):
        sps = [sps] * n
    elif not (isinstance(sps, list) and all(s is None or isinstance(s, dict) for s in sps)):
        raise RequestError("sampling_params must be an object or a list of objects", "sampling_params",
                           "invalid_type")
    if len(sps) != n:
        raise RequestError(f"sampling_params has {len(sps)} entries for {n} prompts", "sampling_params")
    rid = body.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * n
    elif isinstance(rid, str) and rid:
        rids = [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
    elif isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) and r for r in rid):
        rids = list(rid)
    else:
        raise RequestError("rid must be a non-empty string or one string per prompt", "rid", "invalid_type")
    stream = _bool(body, "stream")
    if stream and is_batch:
        raise RequestError("streaming is supported for a single prompt only", "stream")
    ret_lp = _per_item(body, "return_logprob", n, False, lambda x: isinstance(x, bool))
    start = _per_item(body, "logprob_start_len", n, -1, is_int)
    top = _per_item(body, "top_logprobs_num", n, 0, is_int)
    text_lp = _bool(body, "return_text_in_logprobs")
    priority = body.get("priority")
    if priority is not None and not is_int(priority):
        raise RequestError("priority must be an integer", "priority", "invalid_type")
    return [GenerateRequest(texts[i], ids[i], sps[i], rids[i], stream, ret_lp[i], start[i], top[i], text_lp,
                            priority=priority) for i in range(n)], is_batch
