"""Overload on the real model: past max_running + max_queued outstanding requests the server sheds with
503 + Retry-After (no timeout, no 500), every admitted request still completes, and it recovers at once.
(The same bound with the fake scheduler: tests/server/test_supervision.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.conftest import wait_idle
from tests.server.conftest import ServerProc


@pytest.fixture(scope="module")
def server():
    s = ServerProc(
        "--max-total-tokens",
        "4096",
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "2",
        "--log-level",
        "warning",
    )
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


def test_bounded_queue_sheds_with_503_and_recovers(server):
    long = {"text": "Count slowly:", "sampling_params": {"max_new_tokens": 80, "ignore_eos": True}}
    short = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            admitted = [asyncio.ensure_future(client.post("/generate", json=long)) for _ in range(4)]
            await asyncio.sleep(1.0)
            shed = await asyncio.gather(*(client.post("/generate", json=short) for _ in range(6)))
            v1 = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            return await asyncio.gather(*admitted), shed, v1

    admitted, shed, v1 = asyncio.run(run())
    for r in [*shed, v1]:
        assert r.status_code == 503, r.text[:200]
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "server_overloaded" and err["type"] == "server_error", err
    assert [r.status_code for r in admitted] == [200] * 4
    assert all(len(r.json()["output_ids"]) == 80 for r in admitted)
    with server.client() as c:
        wait_idle(c)
        r = c.post("/generate", json=short)
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"] is not None
        assert c.get("/health_generate").status_code == 200
        wait_idle(c)
