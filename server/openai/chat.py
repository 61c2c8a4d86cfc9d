"""POST /v1/chat/completions.

Data flow: strict JSON body -> `Body` (an unknown field is a 400 naming it) -> model check (404) -> messages validated
and normalized (developer -> system, text parts joined) -> tools planned (server/openai/tools.py) -> the
chat template (the model's, or `--chat-template`) rendered and tokenized by `Tokenizer.encode_chat`, so
control tokens come only from the template -> sampling params (+ a JSON-schema constraint for
response_format, a required/named tool_choice or strict tools, in the tool-call format's syntax:
server/openai/tool_format.py; after the thinking for a thinking request: server/openai/reasoning.py) ->
`TokenizerManager.submit` (one handle, n samples) -> each output split into reasoning, content and tool calls
(server/openai/chat_output.py) -> a chat.completion object, or SSE chunks (server/openai/streaming.py).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.chat_template import resolve_chat_template
from runtime.tokenizer.generate_input import GenerateRequest, OpenAINames, RequestError
from runtime.tokenizer.manager import TokenizerManager
from server.http import JSON, ClientGone, ServerState, get_state, until_disconnect
from server.openai import common as C
from server.openai import params as P
from server.openai import reasoning as R
from server.openai import tool_format as F
from server.openai import tools as T
from server.openai.chat_output import OutputPlan, split_output
from server.openai.logprobs import LogprobFormatter
from server.openai.streaming import ChatStream, sse_response

logger = logging.getLogger(__name__)
router = APIRouter()

KNOWN = frozenset({
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "top_k", "min_p", "min_tokens",
    "repetition_penalty", "regex", "ebnf", "chat_template_kwargs", "continue_final_message",
    "add_generation_prompt", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "functions", "function_call", "parallel_tool_calls",
    "priority", "prediction", "rid", "store",
    "separate_reasoning", "stream_reasoning", "thinking_budget",
})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "function": "tool"}
_RESERVED_KWARGS = frozenset({"chat_template", "messages", "tools", "add_generation_prompt"})


@lru_cache(maxsize=8)
def _template(name: str | None, default: str | None) -> str | None:
    return resolve_chat_template(name, default)


def chat_template(state: ServerState, tm: TokenizerManager) -> str:
    try:
        template = _template(state.cfg.server.chat_template, getattr(tm.tokenizer, "chat_template", None))
    except ValueError as e:
        raise RequestError(f"the server's chat template is misconfigured: {e}", None, "chat_template_error", 500,
                           "server_error") from None
    if template is None:
        raise RequestError("this model has no chat template; start the server with --chat-template, or use "
                           "/v1/completions", "messages", "invalid_value")
    return template


# ---------------------------------------------------------------- messages


def _content(v: Any, param: str, role: str) -> str | None:
    if v is None:
        if role == "assistant":
            return None
        raise RequestError(f"'{param}' is required for {role} messages", param, "missing_required_parameter")
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise RequestError(f"'{param}' must be a string or an array of content parts", param, "invalid_type")
    texts = []
    for j, part in enumerate(v):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"'{p}' must be an object", p, "invalid_type")
        kind = part.get("type")
        if kind in ("text", "input_text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise RequestError(f"'{p}.text' must be a string", f"{p}.text", "invalid_type")
            texts.append(text)
        elif kind in ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file"):
            raise RequestError(f"'{p}': {kind} content is not supported (this model takes text only)",
                               f"{p}.type", "invalid_value")
        else:
            raise RequestError(f"'{p}.type' must be 'text', got {kind!r}"[:200], f"{p}.type", "invalid_value")
    return "\n".join(texts)


def parse_messages(v: Any) -> list[dict[str, Any]]:
    if v is None:
        raise RequestError("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(v, list):
        raise RequestError("'messages' must be an array", "messages", "invalid_type")
    if not v:
        raise RequestError("'messages' must not be empty", "messages", "empty_array")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{p}' must be an object", p, "invalid_type")
        role = m.get("role")
        if role is None:
            raise RequestError(f"'{p}.role' is required", f"{p}.role", "missing_required_parameter")
        if not isinstance(role, str) or role not in ROLES:
            raise RequestError(f"'{p}.role' must be one of system, developer, user, assistant, tool; got "
                               f"{role!r}"[:200], f"{p}.role", "invalid_value")
        calls = m.get("tool_calls")
        msg: dict[str, Any] = {"role": ROLES[role],
                               "content": _content(m.get("content"), f"{p}.content", role)}
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"{p}.tool_calls")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise RequestError(f"'{p}.{key}' must be a string", f"{p}.{key}", "invalid_type")
                msg[key] = m[key]
        out.append(msg)
    return out


def _tool_calls(v: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise RequestError(f"'{param}' must be an array", param, "invalid_type")
    out = []
    for k, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"'{param}[{k}].function.name' is required", f"{param}[{k}].function.name",
                               "missing_required_parameter")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise RequestError(f"'{param}[{k}].function.arguments' must be a JSON string",
                               f"{param}[{k}].function.arguments", "invalid_type")
        out.append({"id": c.get("id") or T.new_call_id(), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


# ---------------------------------------------------------------- the request


def tokenize_chat(body: P.Body, state: ServerState, tm: TokenizerManager, messages: list[dict],
                  plan: T.ToolPlan, tool_format: str | None = None) -> list[int]:
    """The prompt's token ids, with the template options a chat body may set (chat_template_kwargs,
    continue_final_message, add_generation_prompt)."""
    kwargs = body.raw("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    if _RESERVED_KWARGS & set(kwargs):
        raise RequestError(f"'chat_template_kwargs' may not set {sorted(_RESERVED_KWARGS & set(kwargs))}",
                           "chat_template_kwargs", "invalid_value")
    cont = body.boolean("continue_final_message")
    add_gen = body.boolean("add_generation_prompt", not cont)
    if cont and messages[-1]["role"] != "assistant":
        raise RequestError("continue_final_message needs a final assistant message", "continue_final_message")
    return render_chat(state, tm, messages, plan, add_gen, cont, kwargs, tool_format)


def render_chat(state: ServerState, tm: TokenizerManager, messages: list[dict], plan: T.ToolPlan,
                add_generation_prompt: bool = True, continue_final: bool = False,
                template_kwargs: dict[str, Any] | None = None, tool_format: str | None = None) -> list[int]:
    """Normalized chat messages (parse_messages' shape) and a tool plan -> the prompt's token ids, rendered by
    the chat template (control tokens come only from it). Every chat-shaped route tokenizes through here.
    `tool_format`: the tool-call format whose call spelling the tool prompt shows (None: generic JSON)."""
    chars = sum(len(m.get("content") or "") for m in messages)
    if chars > 32 * tm.context_len:
        raise RequestError(f"the messages are far longer than the context ({tm.context_len} tokens)", "messages",
                           "context_length_exceeded")
    template = chat_template(state, tm)
    msgs, tool_specs = T.prompt_messages(messages, plan, T.template_supports_tools(template),
                                         F.call_example(tool_format))
    if not T.template_supports_tools(template):
        msgs = [{**m, "content": m.get("content") or ""} for m in msgs]
    try:
        return tm.tokenizer.encode_chat(msgs, add_generation_prompt=add_generation_prompt, tools=tool_specs,
                                        chat_template=template, continue_final_message=continue_final,
                                        **(template_kwargs or {}))
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise RequestError(f"the chat template could not render these messages: {e}"[:500], "messages",
                           "invalid_value") from None


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    srv = state.cfg.server
    body = P.Body(await C.read_body(request, state), KNOWN)
    model = C.check_model(state, body.raw("model"))
    messages = parse_messages(body.raw("messages"))
    if body.has("functions") or body.has("function_call"):
        raise RequestError("'functions' and 'function_call' are deprecated: use 'tools' and 'tool_choice'",
                           "functions", "invalid_value")
    plan = T.parse_tools(body.raw("tools"), body.raw("tool_choice"))
    stream = body.boolean("stream")
    include_usage = P.stream_options(body, stream)
    want_lp = body.boolean("logprobs")
    top = body.integer("top_logprobs", 0, srv.max_top_logprobs)
    if top is not None and not want_lp:
        raise RequestError("when using 'top_logprobs', 'logprobs' must be set to true", "top_logprobs",
                           "invalid_value")
    top = top or 0
    sp = P.sampling_params(body, srv, tm.vocab_size)
    n = P.n_choices(body, srv)
    max_new, max_key = P.max_tokens(body, ("max_completion_tokens", "max_tokens"))
    parallel = body.boolean("parallel_tool_calls", True)
    if body.boolean("store"):
        raise RequestError("'store': chat completions are not stored (the Responses API stores responses)",
                           "store", "unsupported_parameter")
    rid = body.string("rid")
    output = output_plan(body, state, tm, plan, parallel)
    cons, cons_param = P.constraint(body)
    tool_cons = F.constraint(plan, output.tool_format, parallel)
    if tool_cons:
        if cons:  # both would constrain the same output: neither may be dropped silently
            what = f"tool_choice={plan.mode}" if plan.constrained else "a strict tool"
            raise RequestError(f"{what} constrains the output to tool calls; it cannot be combined with "
                               f"'{cons_param}'", "tool_choice" if plan.constrained else "tools", "invalid_value")
        cons, cons_param = tool_cons, "tools"
    ids = tokenize_chat(body, state, tm, messages, plan, output.tool_format)
    sp.update(cons, n=n)
    sp.update(thinking_sampling(output, sp))
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    predicted = P.prediction(body)
    cid = C.new_id("chatcmpl")
    names = OpenAINames(prompt="messages", max_tokens=max_key, constraint=cons_param)
    handle = tm.submit(GenerateRequest(input_ids=ids, sampling_params=sp, rid=rid or cid, stream=stream,
                                       return_logprob=want_lp, top_logprobs_num=top, openai=names,
                                       priority=P.priority(body), prediction=predicted))
    fmt = LogprobFormatter(tm) if want_lp else None
    base = {"id": cid, "object": "chat.completion.chunk", "created": C.now(), "model": model,
            "system_fingerprint": None}
    if stream:
        def usage_of(metas: list[dict[str, Any]]) -> dict[str, Any]:
            u = C.usage(state, [[{"meta_info": m} for m in metas if m]])
            return u if predicted is None else C.with_prediction(u, [m for m in metas if m])

        return sse_response(ChatStream(handle, base, n, output, fmt, top, include_usage, usage_of).events())
    try:
        per_prompt = await until_disconnect(request, C.collect([handle]))
    except ClientGone:
        return Response(status_code=499)
    C.raise_for_aborts(per_prompt)
    choices = [_choice(r, output, fmt, top) for r in per_prompt[0]]
    usage = C.usage(state, per_prompt)
    if predicted is not None:
        usage = C.with_prediction(usage, [r["meta_info"] for r in per_prompt[0]])
    return JSON({**base, "object": "chat.completion", "choices": choices, "usage": usage})


def output_plan(body: P.Body, state: ServerState, tm: TokenizerManager, plan: T.ToolPlan,
                parallel: bool) -> OutputPlan:
    """How this request's outputs are split: reasoning (server/openai/reasoning.py) and the tool-call format."""
    srv = state.cfg.server
    kwargs = body.raw("chat_template_kwargs")
    reasoning = R.plan_reasoning(body.data, srv.reasoning_parser, kwargs if isinstance(kwargs, dict) else None)
    fmt = srv.tool_call_parser
    if fmt is None and plan.tools and plan.mode != "none":
        fmt = F.format_name(None, chat_template(state, tm))
    return OutputPlan(plan, reasoning, fmt, parallel)


def thinking_sampling(output: OutputPlan, sp: dict[str, Any]) -> dict[str, Any]:
    """Sampling params for thinking (constraint after the thinking, budget) and for formats whose markers are
    special tokens (kept in the text unless the request set skip_special_tokens itself)."""
    out = R.thinking_params(output.reasoning)
    tp = output.tool_parser()
    if tp is not None and tp.special_tokens:
        out["skip_special_tokens"] = False
    if "skip_special_tokens" in sp:
        out.pop("skip_special_tokens", None)
    return out


def _choice(r: dict[str, Any], output: OutputPlan, fmt: LogprobFormatter | None, top: int) -> dict[str, Any]:
    meta, text = r["meta_info"], r["text"]
    fr = meta["finish_reason"]
    reason = C.finish_reason(fr)
    split = split_output(output, text)
    content, calls = split.content, split.calls
    if calls and reason == "stop":
        reason = "tool_calls"
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if output.reasoning.parser is not None:
        message["reasoning_content"] = split.reasoning
    if calls:
        message["tool_calls"] = calls
    logprobs = None
    if fmt is not None:
        logprobs = {"content": fmt.chat(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs"),
                                        top), "refusal": None}
    choice = {"index": r["index"], "message": message, "logprobs": logprobs, "finish_reason": reason}
    stop = C.matched_stop(fr)
    if stop is not None:
        choice["matched_stop"] = stop
    return choice
