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
from runtime.tokenizer.manager import TokenizerManager
from server.http import JSON, get_state
from server.openai import common as C

router = APIRouter()


async def _read(request: Request, data_key: str, flag_key: str) -> tuple[TokenizerManager, Any, bool]:
    """The TokenizerManager, the body's `data_key` value (required) and its `flag_key` boolean (default true);
    the model, when given, must be one this server serves."""
    state = get_state(request)
    tm = state.require_tm()
    body = await C.read_body(request, state)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_type")
    C.check_model(state, body.get("model"))
    flag = body.get(flag_key, True)
    if not isinstance(flag, bool):
        raise RequestError(f"'{flag_key}' must be a boolean", flag_key, "invalid_type")
    if body.get(data_key) is None:
        raise RequestError(f"'{data_key}' is required", data_key, "missing_required_parameter")
    return tm, body[data_key], flag


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    tm, prompt, add_special = await _read(request, "prompt", "add_special_tokens")
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
    tm, tokens, skip = await _read(request, "tokens", "skip_special_tokens")
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        return JSON({"text": [_decode(tm.tokenizer, _ids(t, tm.vocab_size), skip) for t in tokens]})
    return JSON({"text": _decode(tm.tokenizer, _ids(tokens, tm.vocab_size), skip)})


def _decode(tokenizer: Any, ids: list[int], skip_special: bool) -> str:
    """The text of `ids` exactly (no space set around kept special tokens, as a fast HF tokenizer decodes)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special, spaces_between_special_tokens=False) if ids else ""
