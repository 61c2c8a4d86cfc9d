"""POST /v1/embeddings (OpenAI's shape) and SGLang's native POST /encode, in embedding mode.

/v1/embeddings: `{"input": str | [str] | [int] | [[int]], "model"?, "encoding_format"?: "float" | "base64",
"dimensions"?: int, "user"?: str, "truncate"?: bool}` -> `{"object": "list", "data": [{"object": "embedding",
"index": i, "embedding": [float] | base64 of float32 little-endian}], "model", "usage": {"prompt_tokens",
"total_tokens"}}`. Token ids are embedded as given (include the model's [CLS]/[SEP], as /tokenize returns
them). `dimensions` is the model's own width, or one it was trained to be cut to (`matryoshka_dimensions` in
its config.json: the vector is cut and re-normalized); any other is a 400. An input past the model's token
limit is a 400 naming the limit unless `truncate` is true (then it is cut to the limit, keeping [SEP]).

/encode: `{"text": str | [str]}` or `{"input_ids": [int] | [[int]]}`, optional `rid`, `truncate` ->
`{"embedding": [float], "meta_info": {"id", "prompt_tokens"}}`, a list of them for a batch.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.embedding import Embedded, parse_inputs
from runtime.tokenizer.generate_input import RequestError, is_int
from runtime.tokenizer.manager import TokenizerManager
from server.http import JSON, ClientGone, get_state, until_disconnect
from server.openai import common as C

router = APIRouter()
KNOWN = frozenset({"input", "model", "encoding_format", "dimensions", "user", "truncate"})


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def _dimensions(body: dict, tm: TokenizerManager) -> int | None:
    """The width to cut to (None: the model's own)."""
    d, dim = body.get("dimensions"), tm.info.embedding_dim
    if d is None or d == dim:
        return None
    if not is_int(d) or d < 1:
        raise RequestError("'dimensions' must be a positive integer", "dimensions", "invalid_type")
    allowed = tm.info.matryoshka_dims
    if d not in allowed:
        extra = f" or one of {list(allowed)}" if allowed else " (the model was not trained to be cut shorter)"
        raise RequestError(f"'dimensions' must be {dim}{extra}, got {d}", "dimensions", "invalid_value")
    return d


def _vector(e: Embedded, dims: int | None) -> np.ndarray:
    v = np.frombuffer(e.embedding, dtype="<f4")
    if dims is not None:
        v = v[:dims]
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.astype("<f4", copy=False)


async def _embed(request: Request, tm: TokenizerManager, inputs: list, truncate: bool, param: str,
                 rid: str | None = None) -> list[Embedded] | None:
    """The embeddings, or None when the client went away (its waiting inputs are aborted)."""
    try:
        return await until_disconnect(request, tm.embeddings.embed(inputs, truncate=truncate, param=param, rid=rid))
    except ClientGone:
        return None


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = C.known_object(await C.read_body(request, state), KNOWN)
    model = C.check_model(state, body.get("model"))
    if "input" not in body or body["input"] is None:
        raise RequestError("'input' is required", "input", "missing_required_parameter")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}"[:200], "encoding_format",
                           "invalid_value")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("'user' must be a string", "user", "invalid_type")
    dims = _dimensions(body, tm)
    inputs = parse_inputs(body["input"], "input")
    results = await _embed(request, tm, inputs, _flag(body, "truncate"), "input")
    if results is None:
        return Response(status_code=499)
    data = []
    for i, e in enumerate(results):
        v = _vector(e, dims)
        emb: Any = base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(e.prompt_tokens for e in results)
    return JSON({"object": "list", "data": data, "model": model,
                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@router.api_route("/encode", methods=["POST", "PUT"])
async def encode(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = await C.read_body(request, state)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_type")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of 'text' and 'input_ids'", "text", "invalid_value")
    param = "text" if text is not None else "input_ids"
    value = text if text is not None else ids
    if text is not None and not (isinstance(text, str) or isinstance(text, list) and all(isinstance(t, str) for t in text)):
        raise RequestError("'text' must be a string or an array of strings", "text", "invalid_type")
    if ids is not None and isinstance(ids, list) and ids and all(isinstance(t, str) for t in ids):
        raise RequestError("'input_ids' must be token ids or arrays of token ids", "input_ids", "invalid_type")
    inputs = parse_inputs(value, param)
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) and rid):
        raise RequestError("'rid' must be a non-empty string", "rid", "invalid_type")
    rid = rid or uuid.uuid4().hex
    results = await _embed(request, tm, inputs, _flag(body, "truncate"), param, rid)
    if results is None:
        return Response(status_code=499)
    out = [{"embedding": _vector(e, None).tolist(), "meta_info": {"id": f"{rid}_{i}", "prompt_tokens": e.prompt_tokens}}
           for i, e in enumerate(results)]
    is_batch = isinstance(value, list) and not (value and all(is_int(t) for t in value))
    return JSON(out if is_batch else out[0])
