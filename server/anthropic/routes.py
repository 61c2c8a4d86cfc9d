"""POST /v1/messages and POST /v1/messages/count_tokens.

Data flow: strict JSON body -> parameters checked (server/anthropic/params.py; unknown or unserved ones are a
400 naming them) -> model check (404) -> `system` + `messages` as chat messages (messages.py) -> tools as a
chat `ToolPlan` (tools.py) -> the chat route's template rendering (server/openai/chat.py `render_chat`; a final
assistant message is continued) -> sampling params (+ a JSON-schema constraint for tool_choice any/tool or
output_config.format) -> `TokenizerManager.submit` -> a message (response.py) or its event stream
(streaming.py, over the chat route's chunk sequence). count_tokens renders the same prompt and counts it.
Errors on these paths use Anthropic's envelope (server/errors.py `envelope`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, NamedTuple, cast

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.generate_input import GenerateRequest, OpenAINames, RequestError
from runtime.tokenizer.manager import RequestHandle, TokenizerManager
from server.anthropic import messages as M
from server.anthropic import params as A
from server.anthropic import response as R
from server.anthropic import tools as AT
from server.anthropic.streaming import MessageStream
from server.errors import anthropic_error_body
from server.http import JSON, ClientGone, ServerState, get_state, until_disconnect
from server.openai import common as C
from server.openai import params as P
from server.openai import tools as T
from server.openai.chat import render_chat
from server.openai.chat_output import OutputPlan, split_output
from server.openai.reasoning import thinking_params
from server.openai.streaming import ChatStream, sse_response

router = APIRouter()


class Prompt(NamedTuple):
    """What both routes render: the prompt's token ids and the tools that shaped it."""

    ids: list[int]
    tools: AT.Tools
    model: str


def _prompt(state: ServerState, tm: TokenizerManager, body: P.Body) -> Prompt:
    model = C.check_model(state, body.raw("model"))
    conv = M.conversation(body.raw("system"), body.raw("messages"))
    tools = AT.parse(body.raw("tools"), body.raw("tool_choice"))
    ids = render_chat(state, tm, conv.messages, tools.plan, add_generation_prompt=not conv.prefill,
                      continue_final=conv.prefill)
    return Prompt(ids, tools, model)


def _constraint(body: P.Body, plan: T.ToolPlan) -> tuple[dict[str, str], str | None]:
    schema = A.output_schema(body)
    if schema is not None and plan.constrained:
        raise RequestError("tool_choice any/tool and output_config.format both constrain the output: give one of "
                           "them", "tool_choice")
    if schema is not None:
        return {"json_schema": schema}, "output_config.format"
    if plan.constrained:
        return {"json_schema": json.dumps(plan.schema(), separators=(",", ":"))}, "tools"
    return {}, None


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = A.body(await C.read_body(request, state), A.COUNT_KNOWN)
    prompt = _prompt(state, tm, body)
    A.output_schema(body)
    return JSON({"input_tokens": len(prompt.ids)})


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = A.body(await C.read_body(request, state), A.KNOWN)
    max_new = A.max_tokens(body)
    sp, stops = A.sampling_params(body, state.cfg.server)
    stream = body.boolean("stream")
    prompt = _prompt(state, tm, body)
    plan, parallel = prompt.tools
    cons, cons_param = _constraint(body, plan)
    thinking = A.thinking_plan(body.raw("thinking"), state.cfg.server.reasoning_parser)
    output = OutputPlan(plan, thinking, None, parallel)  # generic tool reading; reasoning split when thinking
    sp.update(cons, max_new_tokens=max_new)
    sp.update(thinking_params(thinking))
    mid = R.new_message_id()
    names = OpenAINames(prompt="messages", max_tokens="max_tokens", constraint=cons_param)
    handle = tm.submit(GenerateRequest(input_ids=prompt.ids, sampling_params=sp, rid=mid, stream=stream,
                                       openai=names))
    snapshot = R.message(mid, prompt.model)
    if stream:
        try:  # the first output before answering: a request error found by the runtime is still an HTTP 4xx
            first, items = await until_disconnect(request, _peek(handle))
        except ClientGone:
            return Response(status_code=499)
        chunks = ChatStream(items, {}, 1, output, None, 0, True, lambda metas: R.usage(state, metas[0])).events()
        start = {**snapshot, "usage": R.usage(state, first["meta_info"])}
        events = MessageStream(chunks, start, plan.mode == "named" and bool(plan.tools), stops).events()
        return sse_response(events, named=True, done=False,
                            error_chunk=lambda e: anthropic_error_body(e.status, e.message, e.param))
    try:
        per_prompt = await until_disconnect(request, C.collect([handle]))
    except ClientGone:
        return Response(status_code=499)
    C.raise_for_aborts(per_prompt)
    result = per_prompt[0][0]
    out = split_output(output, result["text"])
    return JSON(R.complete(state, snapshot, result, out.content, out.calls, stops, out.reasoning))


async def _peek(handle: RequestHandle) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
    """(the handle's first result, an iterator over all of its results); a request error in the first result
    is raised here. The handle is aborted when the iterator is left early or this is cancelled."""
    it = cast(AsyncGenerator[dict[str, Any], None], handle.__aiter__())  # RequestHandle.__aiter__ is one
    try:
        first = await it.__anext__()
        err = C.abort_error(first["meta_info"]["finish_reason"])
        if err is not None:
            raise err
    except BaseException:
        handle.abort()
        await it.aclose()
        raise

    async def items() -> AsyncIterator[dict[str, Any]]:
        try:
            yield first
            async for item in it:
                yield item
        finally:
            handle.abort()
            await it.aclose()

    return first, items()
