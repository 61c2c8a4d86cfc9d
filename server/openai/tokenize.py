"""POST /tokenize and /detokenize (also under /v1/), with SGLang's request and response shapes.

/tokenize: `{"model"?, "prompt": str | [str], "add_special_tokens"?: bool = true}` ->
`{"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}` (the context length).
/detokenize: `{"model"?, "tokens": [int] | [[int]], "skip_special_tokens"?: bool = true}` ->
`{"text": str | [str]}`; an empty list is "". Both run on the server's tokenizer, no scheduler round trip;
a malformed body is a 400 naming the parameter, an unknown model a 404 (server/openai/common.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.generate_input import RequestError
from server.http import JSON, get_state
from server.openai import common as C

router = APIRouter()


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_type")
    return body


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, True)
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean", key, "invalid_type")
    return value


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = _object(await C.read_body(request, state))
    C.check_model(state, body.get("model"))
    add_special = _flag(body, "add_special_tokens")
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        ids = tm.tokenizer.encode(prompt, add_special_tokens=add_special)
        return JSON({"tokens": ids, "count": len(ids), "max_model_len": tm.context_len})
    if not isinstance(prompt, list) or not all(isinstance(p, str) for p in prompt):
        raise RequestError("'prompt' must be a string or a list of strings", "prompt", "invalid_type")
    batch = [tm.tokenizer.encode(p, add_special_tokens=add_special) for p in prompt]
    return JSON({"tokens": batch, "count": [len(ids) for ids in batch], "max_model_len": tm.context_len})


def _ids(tokens: Any, vocab_size: int) -> list[int]:
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise RequestError("'tokens' must be a list of integers or a list of lists of integers", "tokens",
                           "invalid_type")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})", "tokens")
    return tokens


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = _object(await C.read_body(request, state))
    C.check_model(state, body.get("model"))
    skip = _flag(body, "skip_special_tokens")
    if "tokens" not in body:
        raise RequestError("'tokens' is required", "tokens", "missing_required_parameter")
    tokens = body["tokens"]
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        return JSON({"text": [_decode(tm.tokenizer, _ids(t, tm.vocab_size), skip) for t in tokens]})
    return JSON({"text": _decode(tm.tokenizer, _ids(tokens, tm.vocab_size), skip)})


def _decode(tokenizer: Any, ids: list[int], skip_special: bool) -> str:
    """The text of `ids` exactly (no space set around kept special tokens, as a fast HF tokenizer decodes)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special, spaces_between_special_tokens=False) if ids else ""
