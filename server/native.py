"""SGLang's native HTTP API (docs/protocol.md): /generate, health, model and server info, load, version,
cache flush, abort, metrics.

A request's life here: read strict JSON -> `normalize_generate` -> `TokenizerManager.submit_many`
(validation errors become 400 before anything reaches the scheduler) -> stream SSE chunks or wait for the
final results (with `separate_reasoning`, split into answer and reasoning: server/native_reasoning.py). A client that disconnects aborts its request at once: Starlette cancels a streaming
response when the peer goes away; for plain responses `until_disconnect` races the work against the
connection's `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from kernels import fallbacks
from runtime.messages import FinishAbort
from runtime.models.loader import read_model_type
from runtime.tokenizer.generate_input import GenerateRequest, RequestError, normalize_generate
from runtime.tokenizer.manager import RequestHandle
from server import native_reasoning as R
from server.errors import error_body, read_json
from server.http import JSON, SSE_DONE, ClientGone, get_state, sse, until_disconnect

logger = logging.getLogger(__name__)
router = APIRouter()
T = TypeVar("T")


async def _collect_all(handles: list[RequestHandle]) -> list[dict[str, Any]]:
    try:
        per_prompt = await asyncio.gather(*(h.finals() for h in handles))
    finally:
        for h in handles:
            h.abort()
    return [r for results in per_prompt for r in results]


async def _stream(handle: RequestHandle, reasoning: str | None) -> AsyncIterator[bytes]:
    split = R.CumulativeSplit(reasoning) if reasoning else None
    try:
        async for item in handle:
            out = handle.public(item)
            yield sse(split.apply(out) if split else out)
    except RequestError as e:
        yield sse(error_body(e.message, e.type, e.param, e.code))
    yield SSE_DONE


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = await read_json(request, state.cfg.server.max_body_bytes)
    reasoning = R.reasoning_of(body, state.cfg.server.reasoning_parser)
    reqs, is_batch = normalize_generate(body)
    handles = tm.submit_many(reqs)
    if reqs[0].stream:
        return StreamingResponse(_stream(handles[0], reasoning), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        results = await until_disconnect(request, _collect_all(handles))
    except ClientGone:
        return Response(status_code=499)
    if reasoning:
        results = [R.split_final(reasoning, r) for r in results]
    return JSON(results if is_batch or len(results) > 1 else results[0])


@router.get("/health")
async def health(request: Request) -> Response:
    get_state(request).require_tm()
    return JSON({})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """A real one-token generation through the scheduler (embedding mode: a real one-token embedding)."""
    state = get_state(request)
    tm = state.require_tm()
    if tm.info.is_embedding:
        try:
            await asyncio.wait_for(tm.embeddings.embed([[0]], rid=f"HEALTH_CHECK_{time.time_ns()}"),
                                   state.health_check_timeout)
        except TimeoutError:
            raise RequestError(f"no embedding within {state.health_check_timeout:g} s", None, "unhealthy", 503,
                               "server_error") from None
        return JSON({})
    req = GenerateRequest(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                          rid=f"HEALTH_CHECK_{time.time_ns()}")
    handle = tm.submit(req)
    try:
        results = await asyncio.wait_for(_collect_all([handle]), state.health_check_timeout)
    except TimeoutError:
        raise RequestError(f"no generation within {state.health_check_timeout:g} s", None, "unhealthy", 503,
                           "server_error") from None
    fr = results[0]["meta_info"]["finish_reason"] if results else None
    if fr is None or isinstance(fr, FinishAbort):
        raise RequestError(f"health generation failed: {fr}", None, "unhealthy", 503, "server_error")
    return JSON({})


@functools.lru_cache(maxsize=4)
def _model_type(model_path: str) -> tuple[str | None, list[str] | None]:
    return read_model_type(model_path)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    cfg = state.config_info
    model_type, architectures = await asyncio.to_thread(_model_type, state.model_path)
    return JSON({"model_path": state.model_path, "tokenizer_path": cfg.get("tokenizer_path") or state.model_path,
                 "served_model_name": state.served_model_name, "is_generation": not tm.info.is_embedding,
                 "model_type": model_type, "architectures": architectures,
                 "max_context_length": tm.context_len, "vocab_size": tm.vocab_size,
                 "preferred_sampling_params": None, "weight_version": "default"})


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """SGLang's load report (what sglang-router's power_of_two policy and /get_loads read), one entry per
    data-parallel rank: requests held (running + waiting), waiting requests, and tokens = KV slots held by
    requests (neither free nor evictable cache) + prompt tokens still waiting for admission."""
    s = await get_state(request).require_tm().get_internal_state(timeout=5.0)
    used = s["max_total_num_tokens"] - s["kv_free_slots"] - s["kv_evictable_slots"]
    return JSON([{"dp_rank": 0, "num_reqs": s["num_running_reqs"] + s["num_waiting_reqs"],
                  "num_waiting_reqs": s["num_waiting_reqs"], "num_tokens": used + s["num_waiting_tokens"]}])


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    internal = await tm.get_internal_state()
    info = {k: v for k, v in state.config_info.items() if k != "api_key"}
    info.update(served_model_name=state.served_model_name, max_total_num_tokens=internal.get("max_total_num_tokens"),
                max_req_input_len=tm.context_len - (0 if tm.info.is_embedding else 1), context_length=tm.context_len,
                is_embedding=tm.info.is_embedding,
                internal_states=[internal], version=_version(),
                fallbacks={**tm.info.fallbacks, **internal.get("fallbacks", {}), **fallbacks.recorded()})
    return JSON(info)


@router.get("/version")
async def version() -> Response:
    return JSON({"version": _version()})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    out = await get_state(request).require_tm().flush_cache()
    if not out.success:
        raise RequestError(f"cache not flushed: {out.message}", None, "flush_failed")
    return JSON({"success": True, "message": out.message or "Cache flushed."})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = get_state(request)
    tm = state.require_tm()
    body = await read_json(request, state.cfg.server.max_body_bytes)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_type")
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool) or (rid is not None and not (isinstance(rid, str) and rid)):
        raise RequestError("give rid (a non-empty string) or abort_all (a boolean)", "rid", "invalid_type")
    if rid is None and not abort_all:
        raise RequestError("give rid or abort_all", "rid", "missing_required_parameter")
    tm.abort(rid=rid, abort_all=abort_all)
    return JSON({})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    if not state.cfg.server.enable_metrics:
        raise RequestError("metrics are disabled (--enable-metrics)", None, "not_found", 404, "not_found_error")
    internal = None
    if state.ready and state.tm is not None and not state.failure:
        with contextlib.suppress(RequestError):
            internal = await state.tm.get_internal_state(timeout=5.0)
    text = state.metrics.render(state.cfg.server.metrics_prefix, state.served_model_name, internal)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixgen")
    except PackageNotFoundError:
        return "0.1.0"
