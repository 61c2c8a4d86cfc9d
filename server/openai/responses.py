"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

Data flow: strict JSON body (an unknown parameter, or a known one asking for what radixgen does not serve, is a
400 naming it; server/openai/responses_input.py) -> model check -> `previous_response_id`'s stored conversation
(server/response_store.py) + `instructions` as a system turn + `input` as chat messages -> the chat route's
template rendering and tool plan (server/openai/chat.py, tools.py) -> sampling params (`temperature`, `top_p`,
`max_output_tokens`; a json_schema constraint from `text.format` or a required/named `tool_choice`) ->
`TokenizerManager.submit` -> a response object, or SSE events (server/openai/responses_output.py). With
`store` (default true) the response and its conversation are kept for follow-ups and GET.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.generate_input import GenerateRequest, OpenAINames, RequestError
from server.http import JSON, ClientGone, ServerState, get_state, until_disconnect
from server.openai import common as C
from server.openai import params as P
from server.openai import responses_input as I
from server.openai import responses_output as O
from server.openai import tool_format as F
from server.openai.chat import output_plan, parse_messages, thinking_sampling, tokenize_chat
from server.openai.chat_output import Output, split_output
from server.openai.streaming import sse_response
from server.response_store import StoredResponse

router = APIRouter()


def _metadata(v: Any) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise RequestError("'metadata' must be an object of string values", "metadata", "invalid_type")
    if len(v) > 16:
        raise RequestError("'metadata' may hold at most 16 keys", "metadata", "invalid_value")
    return v


def _history(state: ServerState, prev: str | None) -> list[dict[str, Any]]:
    if prev is None:
        return []
    stored = state.responses.get(prev)
    if stored is None:
        raise RequestError(f"Previous response with id '{prev}' not found.", "previous_response_id",
                           "previous_response_not_found", 404)
    return [dict(m) for m in stored.conversation]


def _usage(state: ServerState, meta: dict[str, Any]) -> dict[str, Any]:
    u = C.usage(state, [[{"meta_info": meta}]])
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    data = await C.read_body(request, state)
    I.refuse_unknown_and_unserved(data)
    body = P.Body(data, I.KNOWN)
    model = C.check_model(state, body.raw("model"))
    prev = body.string("previous_response_id")
    history = _history(state, prev)
    instructions = body.string("instructions")
    turn = I.input_messages(body.raw("input"), I.call_names(history))
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = parse_messages(system + history + turn)
    plan = I.tool_plan(body.raw("tools"), body.raw("tool_choice"))
    parallel = body.boolean("parallel_tool_calls", True)
    store = body.boolean("store", True)
    stream = body.boolean("stream")
    if body.has("stream_options") and not stream:
        raise RequestError("'stream_options' can only be given when 'stream' is true", "stream_options")
    metadata = _metadata(body.raw("metadata"))
    schema, fmt = I.text_format(body.raw("text"))
    output = output_plan(body, state, tm, plan, parallel)
    cons: dict[str, str] = {}
    cons_param: str | None = None
    tool_cons = F.constraint(plan, output.tool_format, parallel)
    if schema is not None and tool_cons:
        raise RequestError(f"tool_choice={plan.mode} (or a strict tool) and a json_schema text.format both constrain "
                           "the output: give one of them", "tool_choice", "invalid_value")
    if schema is not None:
        cons, cons_param = {"json_schema": schema}, "text.format"
    elif tool_cons:
        cons, cons_param = tool_cons, "tools"
    sp = P.sampling_params(body, state.cfg.server, tm.vocab_size)
    sp.update(cons)
    sp.update(thinking_sampling(output, sp))
    max_new = body.integer("max_output_tokens", 1)
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    ids = tokenize_chat(body, state, tm, messages, plan, output.tool_format)
    rid = f"resp_{uuid.uuid4().hex}"
    names = OpenAINames(prompt="input", max_tokens="max_output_tokens", constraint=cons_param)
    handle = tm.submit(GenerateRequest(input_ids=ids, sampling_params=sp, rid=rid, stream=stream, openai=names))
    snapshot = {
        "id": rid, "object": "response", "created_at": C.now(), "status": "in_progress", "background": False,
        "error": None, "incomplete_details": None, "instructions": instructions, "max_output_tokens": max_new,
        "max_tool_calls": None, "model": model, "output": [], "parallel_tool_calls": parallel,
        "previous_response_id": prev, "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
        "store": store, "temperature": sp.get("temperature", 1.0), "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": body.raw("tool_choice") or "auto", "tools": body.raw("tools") or [],
        "top_logprobs": 0, "top_p": sp.get("top_p", 1.0), "truncation": "disabled", "usage": None,
        "user": body.string("user"), "metadata": metadata,
    }

    def finish(out: Output, meta: dict[str, Any], items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        status, details = O.status_of(meta["finish_reason"])
        output = items if items is not None else O.output_items(out, status)
        response = {**snapshot, "status": status, "incomplete_details": details, "output": output,
                    "usage": _usage(state, meta)}
        if store:
            state.responses.put(rid, StoredResponse(response, history + turn + [O.conversation_turn(out)]))
        return response

    if stream:
        return sse_response(O.ResponseStream(handle, snapshot, output, finish).events(), named=True)
    try:
        per_prompt = await until_disconnect(request, C.collect([handle]))
    except ClientGone:
        return Response(status_code=499)
    C.raise_for_aborts(per_prompt)
    result = per_prompt[0][0]
    return JSON(finish(split_output(output, result["text"]), result["meta_info"]))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    stored = get_state(request).responses.get(response_id)
    if stored is None:
        raise RequestError(f"Response with id '{response_id}' not found.", "response_id", "not_found", 404)
    return JSON(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    if not get_state(request).responses.delete(response_id):
        raise RequestError(f"Response with id '{response_id}' not found.", "response_id", "not_found", 404)
    return JSON({"id": response_id, "object": "response", "deleted": True})
