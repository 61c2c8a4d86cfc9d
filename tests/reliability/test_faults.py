"""Faults on one real server with a tiny KV pool: a forced retraction storm must not change any output, and
SIGKILL of the detokenizer stops the whole tree non-zero within 5 s (the scheduler's SIGKILL is
tests/reliability/test_fault_inject.py and tests/server/test_supervision.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.harness import internal, sigkill_child_stops_tree, wait_idle
from tests.server.harness import ServerProc

POOL = 512
MAX_NEW = 16
WORDS = ["north", "south", "tree", "lake", "cloud", "iron", "glass", "bird", "song", "road"]


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--max-total-tokens", str(POOL), "--log-level", "warning", "--dtype", "float32")  # exact equality
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(4 + i % 4)) + f" {i}:"


def _sp() -> dict:
    return {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


def test_retraction_storm_keeps_outputs(server):
    """64 requests need ~64 * 25 slots against a 512-slot pool: decode must retract, and retracted requests
    recompute to exactly the tokens they produce unpressured (8 at a time, which fits)."""
    with server.client(timeout=300) as c:
        wait_idle(c)
        expected = []
        for k in range(0, 64, 8):
            r = c.post(
                "/generate", json={"text": [_prompt(i) for i in range(k, k + 8)], "sampling_params": _sp()}
            )
            assert r.status_code == 200, r.text[:300]
            expected += [o["output_ids"] for o in r.json()]
        calm = internal(c)["num_retracted_reqs"]

    async def run_all():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
            return await asyncio.gather(
                *(
                    client.post("/generate", json={"text": _prompt(i), "sampling_params": _sp()})
                    for i in range(64)
                )
            )

    results = asyncio.run(run_all())
    assert [r.status_code for r in results] == [200] * 64
    outs = [r.json() for r in results]
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 64
    with server.client() as c:
        st = wait_idle(c)
    assert st["num_retracted_reqs"] > calm, st  # the storm really retracted
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
    mismatched = [i for i in range(64) if outs[i]["output_ids"] != expected[i]]
    assert mismatched == [], mismatched


def test_last_detokenizer_sigkill_stops_tree_within_5s(server):
    """Must stay last: it ends the module's server."""
    sigkill_child_stops_tree(server, "rg-detokenizer")
    assert "the detokenizer process was killed by signal SIGKILL" in server.output
