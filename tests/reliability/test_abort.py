"""Aborts in the style of vLLM's test_abort and SGLang's TestAbortAll, on one real server with a small
running bound (so requests wait) and a small chunked-prefill size (so a long prompt spans many steps).

Survivors of a mixed abort must produce exactly the greedy tokens of an unaborted run; afterwards nothing
runs, no KV slot leaked, and the aborted rids can be used again.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.reliability.harness import wait_idle
from tests.server.harness import ServerProc

MAX_NEW = 6
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "quick", "brown", "fox", "lazy", "dog", "sun"]


@pytest.fixture(scope="module")
def server():
    s = ServerProc(
        "--max-total-tokens",
        "16384",
        "--max-running-requests",
        "16",
        "--chunked-prefill-size",
        "32",
        "--log-level",
        "warning",
        "--dtype",
        "float32",  # outputs compared exactly with an unaborted batch
    )
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 5)) + f" {i}"


def _body(i: int, n: int, stream: bool, rid: str, max_new: int = MAX_NEW) -> dict:
    return {
        "text": _prompt(i),
        "rid": rid,
        "stream": stream,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True, "n": n},
    }


async def _stream(client: httpx.AsyncClient, body: dict, cut: bool) -> dict[int, list[int]] | None:
    """Final output_ids per sample index, or None when `cut` (closed after the first chunk)."""
    out: dict[int, list[int]] = {}
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            if cut:
                return None
            out[ev.get("index", 0)] = ev["output_ids"]
    return out


def test_100_streams_10_cancelled_survivors_exact(server):
    """Rids ab0..ab99: cancelling "ab2" must not abort "ab20".."ab29" (a bare prefix match once did)."""
    ns = [3 if i % 10 in (1, 5) else 1 for i in range(100)]  # 20 use n=3, of which 7 are among the cancelled
    cancelled = {i for i in range(100) if i % 10 == 1 or i in (2, 12, 22)}
    cancelled = set(sorted(cancelled)[:10])
    with server.client(timeout=300) as c:  # reference: the same greedy requests, unaborted, one batch
        ref = c.post(
            "/generate",
            json={
                "text": [_prompt(i) for i in range(100)],
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
            },
        )
        assert ref.status_code == 200, ref.text[:300]
        expected = [o["output_ids"] for o in ref.json()]
        wait_idle(c)

    async def run_all():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(_stream(client, _body(i, ns[i], True, f"ab{i}"), i in cancelled) for i in range(100))
            )

    results = asyncio.run(run_all())
    for i, res in enumerate(results):
        if i in cancelled:
            assert res is None
            continue
        assert sorted(res) == list(range(ns[i])), (i, res)
        for ids in res.values():  # greedy: every sample equals the reference
            assert ids == expected[i], (i, ids, expected[i])
    with server.client() as c:
        wait_idle(c)
        for i in sorted(cancelled):  # the aborted rids are free again
            r = c.post("/generate", json=_body(i, ns[i], False, f"ab{i}"))
            assert r.status_code == 200, r.text[:200]
            outs = r.json() if ns[i] > 1 else [r.json()]
            assert [o["output_ids"] for o in outs] == [expected[i]] * ns[i]
        wait_idle(c)


def test_abort_all_running_and_waiting(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            tasks = [
                asyncio.ensure_future(client.post("/generate", json=_body(i, 1, False, f"all{i}", 400)))
                for i in range(24)
            ]  # 16 run, 8 wait
            await asyncio.sleep(1.5)
            r = await client.post("/abort_request", json={"abort_all": True})
            assert r.status_code == 200
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    reasons = [r.json()["meta_info"]["finish_reason"] for r in results]
    assert all(fr["type"] == "abort" for fr in reasons), reasons
    assert all(len(r.json()["output_ids"]) < 400 for r in results)
    with server.client() as c:
        wait_idle(c)


def test_abort_mid_chunked_prefill(server):
    """A ~1500-token prompt in 32-token chunks takes many steps; an abort lands while it is the chunked one."""
    body = {"text": "hello " * 1500, "rid": "chunky", "sampling_params": {"max_new_tokens": 4}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            task = asyncio.ensure_future(client.post("/generate", json=body))
            await asyncio.sleep(0.5)
            st = (await client.get("/get_server_info")).json()["internal_states"][0]
            r = await client.post("/abort_request", json={"rid": "chunky"})
            assert r.status_code == 200
            return st, await task

    st, r = asyncio.run(run())
    assert st["num_running_reqs"] == 1 and st["prefill_tokens"] > 0, st  # it was mid-prefill
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0, meta
    with server.client() as c:
        wait_idle(c)
        r = c.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1}})  # rid reusable
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"
        wait_idle(c)
