"""POST /v1/completions.

`prompt` is a string, a list of strings, a list of token ids, or a list of token-id lists; each prompt is
tokenized here (plain text: control-token text in it is read as the model's control tokens, as with any
raw completion prompt) and sent as its own handle with n samples. Choice `index` = prompt number * n +
sample number. `echo` prepends the prompt (its text, or the decoded ids) to each choice, and with
`logprobs` adds the prompt tokens' logprobs (the first one null). `logprobs` is an int: that many
alternatives per position in `top_logprobs` (0: only the chosen tokens). Default `max_tokens` 16 (OpenAI),
clamped to the room left in the context.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.messages import FinishReason
from runtime.tokenizer.generate_input import GenerateRequest, OpenAINames, RequestError, is_int
from runtime.tokenizer.manager import TokenizerManager
from server.http import JSON, ClientGone, ServerState, get_state, until_disconnect
from server.openai import common as C
from server.openai import params as P
from server.openai.logprobs import LogprobFormatter, merge
from server.openai.streaming import merged, sse_response

router = APIRouter()

KNOWN = frozenset({
    "prompt", "model", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "top_k",
    "min_p", "min_tokens", "repetition_penalty", "regex", "ebnf", "json_schema", "response_format",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "priority",
})
DEFAULT_MAX_TOKENS = 16


def parse_prompts(v: Any, tm: TokenizerManager) -> list[tuple[list[int], str | None]]:
    """[(token ids, prompt text or None for id prompts)] for each prompt."""
    if v is None:
        raise RequestError("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(v, str):
        items: list[Any] = [v]
    elif isinstance(v, list):
        if not v:
            raise RequestError("'prompt' must not be empty", "prompt", "empty_array")
        items = [v] if all(is_int(t) for t in v) else v
    else:
        raise RequestError("'prompt' must be a string, an array of strings, an array of token ids or an array "
                           "of token-id arrays", "prompt", "invalid_type")
    out: list[tuple[list[int], str | None]] = []
    for i, p in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise RequestError("the prompt is empty", param, "invalid_value")
            if len(p) > 32 * tm.context_len:
                raise RequestError(f"the prompt is far longer than the context ({tm.context_len} tokens)", param,
                                   "context_length_exceeded")
            out.append((tm.tokenizer.encode(p), p))
        elif isinstance(p, list) and all(is_int(t) for t in p):
            if not p:
                raise RequestError("the prompt is empty", param, "empty_array")
            if any(not 0 <= t < tm.vocab_size for t in p):
                raise RequestError(f"token ids must be in [0, {tm.vocab_size})", param, "invalid_value")
            out.append((list(p), None))
        else:
            raise RequestError("each prompt must be a string or an array of token ids", param, "invalid_type")
    return out


def _constraint(body: P.Body) -> tuple[dict[str, str], str | None]:
    js = body.raw("json_schema")
    text = None
    if js is not None:
        if isinstance(js, str):
            try:
                js = json.loads(js)
            except ValueError:
                raise RequestError("'json_schema' is not valid JSON", "json_schema", "invalid_value") from None
        text = P.check_schema(js, "json_schema")
    return P.constraint(body, text)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    srv = state.cfg.server
    body = P.Body(await C.read_body(request, state), KNOWN)
    model = C.check_model(state, body.raw("model"))
    prompts = parse_prompts(body.raw("prompt"), tm)
    if body.string("suffix"):
        raise RequestError("'suffix' is not supported", "suffix", "invalid_value")
    for key in ("separate_reasoning", "stream_reasoning"):
        if body.boolean(key):
            raise RequestError(f"'{key}': /v1/completions returns raw text; use /v1/chat/completions (with "
                               "--reasoning-parser) for separated reasoning", key, "unsupported_parameter")
    stream = body.boolean("stream")
    include_usage = P.stream_options(body, stream)
    echo = body.boolean("echo")
    k = body.integer("logprobs", 0, srv.max_top_logprobs)
    n = P.n_choices(body, srv)
    best_of = body.integer("best_of", 1, srv.max_n)
    if best_of is not None and best_of != n:
        raise RequestError("'best_of' must equal 'n' (or be omitted)", "best_of", "invalid_value")
    if stream and echo and k is not None:
        raise RequestError("'echo' with 'logprobs' is not supported when streaming", "echo", "invalid_value")
    sp = P.sampling_params(body, srv, tm.vocab_size)
    cons, cons_param = _constraint(body)
    sp.update(cons, n=n)
    max_new, _ = P.max_tokens(body, ("max_tokens",))
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    reqs = []
    cid = C.new_id("cmpl")
    for i, (ids, _text) in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        names = OpenAINames(prompt=param, max_tokens="max_tokens", constraint=cons_param,
                            default_max_tokens=DEFAULT_MAX_TOKENS)
        reqs.append(GenerateRequest(input_ids=ids, sampling_params=sp, rid=f"{cid}-{i}", stream=stream,
                                    return_logprob=k is not None, logprob_start_len=0 if echo and k is not None
                                    else -1, top_logprobs_num=k or 0, openai=names, priority=P.priority(body)))
    handles = tm.submit_many(reqs)
    fmt = LogprobFormatter(tm) if k is not None else None
    echoes = [(text if text is not None else tm.tokenizer.decode(ids, skip_special_tokens=False)) if echo else "" for ids, text in prompts]
    base = {"id": cid, "object": "text_completion", "created": C.now(), "model": model, "system_fingerprint": None}
    if stream:
        return sse_response(_stream(state, handles, base, n, echoes, fmt, k or 0, include_usage))
    try:
        per_prompt = await until_disconnect(request, C.collect(handles))
    except ClientGone:
        return Response(status_code=499)
    C.raise_for_aborts(per_prompt)
    choices = []
    for p, results in enumerate(per_prompt):
        for r in results:
            meta = r["meta_info"]
            logprobs = None
            if fmt is not None:
                pre = len(echoes[p])
                logprobs = fmt.completion(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs"),
                                          k or 0, pre)
                if echo:
                    logprobs = merge(fmt.completion(meta.get("input_token_logprobs") or [],
                                                    meta.get("input_top_logprobs"), k or 0, 0), logprobs)
            choices.append(_choice(p * n + r["index"], echoes[p] + r["text"], logprobs, meta["finish_reason"]))
    return JSON({**base, "choices": choices, "usage": C.usage(state, per_prompt)})


def _choice(index: int, text: str, logprobs: Any, fr: FinishReason | None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": C.finish_reason(fr)}
    stop = C.matched_stop(fr)
    if stop is not None:
        choice["matched_stop"] = stop
    return choice


async def _stream(state: ServerState, handles: list, base: dict[str, Any], n: int, echoes: list[str],
                  fmt: LogprobFormatter | None, k: int, include_usage: bool) -> Any:
    sent: dict[int, tuple[int, int]] = {}  # choice index -> (text chars sent, logprob entries sent)
    finals: list[list[dict[str, Any]]] = [[] for _ in handles]

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        out = {**base, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    for p, text in enumerate(echoes):
        if text:
            for j in range(n):
                sent[p * n + j] = (0, 0)
                yield chunk(_choice(p * n + j, text, None, None))
    async for p, item in merged(handles):
        meta, fr = item["meta_info"], item["meta_info"]["finish_reason"]
        err = C.abort_error(fr)
        if err is not None:
            raise err
        idx = p * n + item["index"]
        chars, lps = sent.get(idx, (0, 0))
        new = item["text"][chars:]
        logprobs = None
        pairs = meta.get("output_token_logprobs") or []
        if fmt is not None and (new or fr is not None):
            tops = meta.get("output_top_logprobs")
            logprobs = fmt.completion(pairs[lps:], tops[lps:] if tops else None, k, len(echoes[p]) + chars)
            lps = len(pairs)
        if new or fr is not None:
            yield chunk(_choice(idx, new, logprobs, fr))
        sent[idx] = (chars + len(new), lps)
        if fr is not None:
            finals[p].append(item)
    if include_usage:
        yield {**base, "choices": [], "usage": C.usage(state, finals)}
