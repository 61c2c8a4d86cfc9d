"""GET /v1/models and /v1/models/{id}: the served model as an OpenAI model card, with `max_model_len` (the
context length, as vLLM reports it; LlamaIndex and others read it). An unknown id is a 404
`model_not_found`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.generate_input import RequestError
from server.http import JSON, ServerState, get_state
from server.openai.common import served_names

router = APIRouter()
_CREATED: dict[int, int] = {}


def _card(state: ServerState, name: str, context_len: int) -> dict[str, Any]:
    created = _CREATED.setdefault(id(state), int(time.time()))
    return {"id": name, "object": "model", "created": created, "owned_by": "radixgen", "root": state.model_path,
            "parent": None, "max_model_len": context_len}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    return JSON({"object": "list", "data": [_card(state, state.served_model_name, tm.context_len)]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    if model_id not in served_names(state):
        raise RequestError(f"The model `{model_id}` does not exist.", "model", "model_not_found", 404)
    return JSON(_card(state, model_id, tm.context_len))
