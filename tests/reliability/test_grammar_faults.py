"""Runaway grammar compiles on one real server (SmolLM2, a raised --grammar-compile-timeout so a runaway is
clearly pending): an abort lands while the grammar compiles, and a compile that never finishes costs plain
requests nothing (they finish, with their unpressured tokens, while it is still pending).

The runaway: a bounded repetition of a JSON-string body that passes validation but whose index build is
exponential in the bound (tests/runtime/constrained/test_model.py::test_runaway_compile_aborts_while_others_
stream). Each test uses its own bound, since the backend caches a timed-out compile under its spec.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.reliability.harness import wait_idle
from tests.server.harness import ServerProc

TIMEOUT = 30.0  # --grammar-compile-timeout: far above the time the plain requests and the abort take (even at load 7)


def runaway(bound: int) -> str:
    return r'"([^"\\]|\\["\\/bfnrt]){0,' + str(bound) + '}"'


@pytest.fixture(scope="module")
def server():
    # outlines: the backend whose index build the runaway regex makes exponential (llguidance, the default,
    # bounds its own work and compiles it at once)
    s = ServerProc(
        "--max-total-tokens", "4096", "--grammar-compile-timeout", str(TIMEOUT), "--log-level", "warning",
        "--grammar-backend", "outlines", "--dtype", "float32",  # exact equality: quantized kernels switch by rows
    )  # fmt: skip
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


async def _stream(client: httpx.AsyncClient, body: dict) -> list[dict]:
    """Every event of a streamed /generate, up to [DONE]."""
    events = []
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


async def _until_compiling(client: httpx.AsyncClient, deadline_s: float = 10.0) -> dict:
    """Internal state once exactly one request waits in the grammar queue."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        st = (await client.get("/get_server_info")).json()["internal_states"][0]
        if st["num_grammar_queue_reqs"] == 1:
            return st
        await asyncio.sleep(0.05)
    raise AssertionError("the constrained request never showed up in the grammar queue")


def _constrained(rid: str, bound: int) -> dict:
    return {
        "text": "A JSON string:",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "regex": runaway(bound)},
    }


def test_abort_while_grammar_compiles(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            t0 = time.monotonic()
            task = asyncio.ensure_future(_stream(client, _constrained("gc-abort", 40)))
            st = await _until_compiling(client)
            assert not task.done()
            r = await client.post("/abort_request", json={"rid": "gc-abort"})
            assert r.status_code == 200, r.text
            events = await task
            return st, events, time.monotonic() - t0

    st, events, elapsed = asyncio.run(run())
    assert st["num_running_reqs"] == 0, st  # it never got past the grammar queue
    fr = events[-1]["meta_info"]["finish_reason"]
    assert fr == {"type": "abort", "message": "aborted by client"}, fr  # the abort, not the compile timeout
    assert events[-1]["output_ids"] == [] and events[-1]["meta_info"]["completion_tokens"] == 0
    assert elapsed < TIMEOUT / 2, elapsed
    with server.client() as c:
        wait_idle(c)
        body = {
            "text": "Hello",
            "rid": "gc-abort",
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        }
        r = c.post("/generate", json=body)  # the rid is free again
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "length" and len(r.json()["output_ids"]) == 3
        assert c.get("/health_generate").status_code == 200
        wait_idle(c)


PLAIN = {
    "text": ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"],
    "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
}


def test_runaway_compile_costs_plain_requests_nothing(server):
    with server.client(timeout=120) as c:
        wait_idle(c)
        ref = c.post("/generate", json=PLAIN)  # no runaway pending
        assert ref.status_code == 200, ref.text[:300]
        expected = [o["output_ids"] for o in ref.json()]

    order: list[str] = []

    async def runaway_stream(client: httpx.AsyncClient) -> list[dict]:
        events = await _stream(client, _constrained("gc-runaway", 41))
        order.append("runaway ended")
        return events

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            task = asyncio.ensure_future(runaway_stream(client))
            await _until_compiling(client)
            r = await client.post("/generate", json=PLAIN)
            order.append("plain done")
            st = (await client.get("/get_server_info")).json()["internal_states"][0]
            return r, st, await task

    r, st_after_plain, events = asyncio.run(run())
    assert r.status_code == 200, r.text[:300]
    outs = r.json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 4
    assert [o["output_ids"] for o in outs] == expected
    assert order == ["plain done", "runaway ended"], order
    assert st_after_plain["num_grammar_queue_reqs"] == 1, st_after_plain  # still compiling when they finished
    fr = events[-1]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "timed out" in fr["message"], fr
    assert events[-1]["output_ids"] == []
    with server.client() as c:
        wait_idle(c)
        assert c.get("/health_generate").status_code == 200
