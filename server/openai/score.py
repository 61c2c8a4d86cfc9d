"""POST /v1/score (SGLang's shape) on a generative model: for a query and candidate items, the probability
of each label token as the next token after query + item (item + query with `item_first`).

Request: `{"query": str | [int], "items": str | [str] | [[int]], "label_token_ids": [int], "apply_softmax"?:
bool = false, "item_first"?: bool = false, "model"?}`; text query and items are concatenated as text and
tokenized together (as SGLang does), token ids concatenated as given. Response: `{"scores": [[p per label]
per item], "model", "object": "scoring", "usage"}`; `p` is exp(logprob), or with `apply_softmax` the softmax
of the label logprobs over the labels.

Machinery: the logprobs of a continuation, as `select` measures them (frontend_lang RuntimeEndpoint): each
(item, label) is one `max_new_tokens: 0` request of prompt + [label] with `return_logprob` and
`logprob_start_len = len(prompt)`, whose only input logprob is the label's. The shared prefix (the query,
or each item with `item_first`) is prefilled first by its own request, so the radix cache serves it to every
item; and every item's prompt serves its labels.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.tokenizer.generate_input import GenerateRequest, RequestError, is_int
from runtime.tokenizer.manager import TokenizerManager
from server.http import JSON, ClientGone, get_state, until_disconnect
from server.openai import common as C

router = APIRouter()
KNOWN = frozenset({"query", "items", "label_token_ids", "apply_softmax", "item_first", "model"})
MAX_LABELS = 64


def _bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def _ids(v: Any, param: str, vocab: int) -> list[int]:
    if not v:
        raise RequestError(f"'{param}' must not be empty", param, "invalid_value")
    if any(not 0 <= t < vocab for t in v):
        raise RequestError(f"'{param}': token ids must be in [0, {vocab})", param, "invalid_value")
    return list(v)


def prompts(body: dict, tm: TokenizerManager) -> tuple[list[list[int]], list[int]]:
    """(one prompt's ids per item, the shared prefix's ids) from the body's query/items/item_first."""
    query, items, item_first = body.get("query"), body.get("items"), _bool(body, "item_first")
    if query is None or items is None:
        raise RequestError("'query' and 'items' are required", "query" if query is None else "items",
                           "missing_required_parameter")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise RequestError("'items' must be a string or a non-empty array", "items", "invalid_type")
    if isinstance(query, str) and all(isinstance(x, str) for x in items):
        if not query:
            raise RequestError("'query' must not be empty", "query", "invalid_value")
        texts = [x + query if item_first else query + x for x in items]
        ids = tm.tokenizer.encode_batch(texts)
        prefix = [] if item_first else tm.tokenizer.encode(query)
        return ids, prefix
    is_ids = isinstance(query, list) and all(is_int(t) for t in query)
    if is_ids and all(isinstance(x, list) and all(is_int(t) for t in x) for x in items):
        q = _ids(query, "query", tm.vocab_size)
        its = [_ids(x, f"items[{i}]", tm.vocab_size) for i, x in enumerate(items)]
        return [x + q if item_first else q + x for x in its], ([] if item_first else q)
    raise RequestError("'query' and 'items' must both be text (a string and strings) or both token ids (an array "
                       "and arrays of ids)", "items", "invalid_type")


def _labels(body: dict, vocab: int) -> list[int]:
    labels = body.get("label_token_ids")
    if labels is None:
        raise RequestError("'label_token_ids' is required", "label_token_ids", "missing_required_parameter")
    if not isinstance(labels, list) or not labels or not all(is_int(t) for t in labels):
        raise RequestError("'label_token_ids' must be a non-empty array of token ids", "label_token_ids",
                           "invalid_type")
    if len(labels) > MAX_LABELS:
        raise RequestError(f"at most {MAX_LABELS} label_token_ids", "label_token_ids", "invalid_value")
    return _ids(labels, "label_token_ids", vocab)


async def _logprobs(tm: TokenizerManager, items: list[list[int]], prefix: list[int],
                    labels: list[int]) -> tuple[list[list[float]], int]:
    """[item][label] logprob of the label right after the item's prompt, and the prompt tokens computed."""
    if len(prefix) > 1:  # prefill the shared prefix once; every item's request then extends it from the cache
        warm = GenerateRequest(input_ids=prefix, sampling_params={"max_new_tokens": 0})
        await C.collect(tm.submit_many([warm]))
    reqs = [GenerateRequest(input_ids=p + [t], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            logprob_start_len=len(p)) for p in items for t in labels]
    per = await C.collect(tm.submit_many(reqs))
    C.raise_for_aborts(per)
    flat = [r[0]["meta_info"]["input_token_logprobs"][-1][0] for r in per]
    k = len(labels)
    return [flat[i * k : (i + 1) * k] for i in range(len(items))], sum(len(p) for p in items)


def _scores(logprobs: list[float], softmax: bool) -> list[float]:
    if softmax:
        top = max(logprobs)
        exps = [math.exp(x - top) for x in logprobs]
        total = sum(exps)
        return [e / total for e in exps]
    return [math.exp(x) for x in logprobs]


@router.post("/v1/score")
async def score(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = C.known_object(await C.read_body(request, state), KNOWN)
    model = C.check_model(state, body.get("model"))
    labels = _labels(body, tm.vocab_size)
    items, prefix = prompts(body, tm)
    softmax = _bool(body, "apply_softmax")
    too_long = [i for i, p in enumerate(items) if len(p) + 1 > tm.context_len]
    if too_long:
        raise RequestError(f"items[{too_long[0]}]: query plus item is longer than the context "
                           f"({tm.context_len} tokens)", f"items[{too_long[0]}]", "context_length_exceeded")
    try:
        lps, tokens = await until_disconnect(request, _logprobs(tm, items, prefix, labels))
    except ClientGone:
        return Response(status_code=499)
    return JSON({"scores": [_scores(row, softmax) for row in lps], "model": model, "object": "scoring",
                 "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}})
