"""Pieces both OpenAI generation routes share: reading the body, the model check, collecting results,
finish reasons, aborts that are really request errors, and `usage`.

Results are TokenizerManager dicts: `{"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", ...logprobs}, "index"}`, one handle per prompt, `index` the sample
number among n.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request

from runtime.messages import FinishAbort, FinishLength, FinishReason, FinishStop
from runtime.tokenizer.generate_input import RequestError
from runtime.tokenizer.manager import RequestHandle
from server.errors import read_json
from server.http import ServerState


async def read_body(request: Request, state: ServerState) -> Any:
    """The JSON body (413 past the cap); a non-JSON Content-Type is a 400."""
    ctype = request.headers.get("content-type")
    if ctype is not None and "json" not in ctype.lower():
        raise RequestError(f"Content-Type must be application/json, got {ctype!r}"[:200], None,
                           "invalid_content_type")
    return await read_json(request, state.cfg.server.max_body_bytes)


# Names that mean "whatever this server serves": the README's and SGLang's examples send "default";
# sglang-router fills a missing `model` with "unknown" before proxying.
DEFAULT_NAMES = frozenset({"default", "unknown"})


def check_model(state: ServerState, model: Any) -> str:
    """The model name to echo: the request's when it is the served name or the model path, the served name
    when it is missing, "default" or "unknown"; any other name is a 404 `model_not_found`."""
    if model is None:
        return state.served_model_name
    if not isinstance(model, str):
        raise RequestError("'model' must be a string", "model", "invalid_type")
    if model in served_names(state):
        return model
    if model in DEFAULT_NAMES:
        return state.served_model_name
    raise RequestError(f"The model `{model}` does not exist.", "model", "model_not_found", 404)


def served_names(state: ServerState) -> tuple[str, ...]:
    return tuple(n for n in (state.served_model_name, state.model_path) if n)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(fr: FinishReason | None) -> str | None:
    """OpenAI's finish_reason: "stop", "length" or "abort" (None while running)."""
    return None if fr is None else fr.type


def matched_stop(fr: FinishReason | None) -> str | int | None:
    """The stop string or token id that ended the request (SGLang's `matched_stop`), if any."""
    return fr.matched if isinstance(fr, FinishStop | FinishLength) else None


def abort_error(fr: FinishReason | None) -> RequestError | None:
    """An abort caused by the request itself (its grammar failed to compile or is unsupported) as a 400;
    None for other finishes (an operator's abort stays finish_reason "abort")."""
    if not isinstance(fr, FinishAbort):
        return None
    message = fr.message or "request aborted"
    status = fr.status_code
    lowered = message.lower()
    if "grammar" in lowered or "constrained" in lowered or "schema" in lowered or "regex" in lowered:
        code = "grammar_too_complex" if "timed out" in lowered or "too complex" in lowered else "invalid_value"
        return RequestError(message, None, code, status if isinstance(status, int) and status < 500 else 400)
    if isinstance(status, int) and 400 <= status < 600:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return RequestError(message, None, "request_aborted", status, kind)
    return None


async def collect(handles: list[RequestHandle]) -> list[list[dict[str, Any]]]:
    """Every handle's finished samples, in sample order; all are aborted if this is cancelled."""

    async def one(h: RequestHandle) -> list[dict[str, Any]]:
        out: list[dict[str, Any] | None] = [None] * len(h.rids)
        async for item in h:
            if item["meta_info"]["finish_reason"] is not None:
                out[item["index"]] = item
        return [r for r in out if r is not None]

    try:
        return list(await asyncio.gather(*(one(h) for h in handles)))
    finally:
        for h in handles:
            h.abort()


def raise_for_aborts(per_prompt: list[list[dict[str, Any]]]) -> None:
    for results in per_prompt:
        for r in results:
            err = abort_error(r["meta_info"]["finish_reason"])
            if err is not None:
                raise err


def usage(state: ServerState, per_prompt: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Prompt tokens counted once per prompt; cached tokens per prompt as its least-cached sample saw them."""
    prompt = completion = cached = 0
    for results in per_prompt:
        if not results:
            continue
        metas = [r["meta_info"] for r in results]
        prompt += metas[0]["prompt_tokens"]
        completion += sum(m["completion_tokens"] for m in metas)
        cached += min(m.get("cached_tokens", 0) for m in metas)
    return usage_dict(state, prompt, completion, cached)


def with_prediction(usage: dict[str, Any], metas: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's completion_tokens_details for a request with a `prediction`: the proposed tokens the model
    accepted and those it rejected (proposals come from the prediction, else from the request's own text)."""
    acc = sum(m.get("spec_accepted_tokens", 0) for m in metas)
    drafted = sum(m.get("spec_draft_tokens", 0) for m in metas)
    return {**usage, "completion_tokens_details": {"accepted_prediction_tokens": acc,
                                                   "rejected_prediction_tokens": drafted - acc}}


def usage_dict(state: ServerState, prompt: int, completion: int, cached: int) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    out["prompt_tokens_details"] = {"cached_tokens": cached} if state.cfg.server.enable_cache_report else None
    return out


def known_object(body: Any, known: frozenset[str]) -> dict[str, Any]:
    """The request body as a JSON object of `known` keys only: a 400 for another type or naming the first
    unknown key (routes without OpenAI's informational fields: /v1/embeddings, /v1/score)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown parameter '{unknown[0]}'", unknown[0], "unknown_parameter")
    return body
