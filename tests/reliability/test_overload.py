"""Overload on the real model: past max_running + max_queued outstanding requests the server sheds with
503 + Retry-After (no timeout, no 500), every admitted request still completes, and it recovers at once.
(The same bound with the fake scheduler: tests/server/test_supervision.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.harness import wait_idle
from tests.server.harness import ServerProc


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


async def _until_held(client: httpx.AsyncClient, n: int, timeout: float = 30.0) -> None:
    """Wait until the scheduler holds `n` requests (running + waiting), i.e. all were admitted."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (await client.get("/get_load")).json()[0]["num_reqs"] < n:
        assert asyncio.get_running_loop().time() < deadline, f"{n} requests never admitted"
        await asyncio.sleep(0.02)


def test_bounded_queue_sheds_with_503_and_recovers(server):
    # Long enough that none of the 4 admitted requests can finish before the shed wave is answered, however
    # fast decode is (2 run, 2 wait: >= 300 steps at batch 2 before a slot frees).
    n_long = 300
    long = {"text": "Count slowly:", "sampling_params": {"max_new_tokens": n_long, "ignore_eos": True}}
    short = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            admitted = [asyncio.ensure_future(client.post("/generate", json=long)) for _ in range(4)]
            await _until_held(client, 4)
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
    assert all(len(r.json()["output_ids"]) == n_long for r in admitted)
    with server.client() as c:
        wait_idle(c)
        r = c.post("/generate", json=short)
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"] is not None
        assert c.get("/health_generate").status_code == 200
        wait_idle(c)
