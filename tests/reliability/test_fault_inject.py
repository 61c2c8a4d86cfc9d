"""An exception injected in one request's processing, on a real server (SmolLM2): only that request fails.

The server's scheduler comes from tests/reliability/faulty_scheduler.py with a failpoint on rid "poison": it
raises while processing that request's third sampled token (a decode step, so it holds KV then).
It must end with an "internal error" abort while 8 concurrent requests produce exactly the tokens they produce
without it; then the server is healthy, nothing leaked, and the traceback is in the log.
(The same at scheduler level with a fake runner: tests/runtime/scheduler/test_faults.py.)
Last, SIGKILL of that real scheduler stops the whole server, exit code 1, within 5 s and leaves no process
(with the model-free scheduler: tests/server/test_supervision.py).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.harness import sigkill_child_stops_tree, wait_idle
from tests.server.harness import ServerProc

AT_TOKEN = 3
PROMPTS = [
    f"Item {i}: the {w} is"
    for i, w in enumerate(["sky", "sea", "road", "tree", "lamp", "door", "bird", "moon"])
]
SP = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
REASON = "internal error while processing request: RuntimeError: injected fault"


@pytest.fixture(scope="module")
def server():
    env = {"RADIXGEN_SCHEDULER_FACTORY": "tests.reliability.faulty_scheduler:create",
           "RADIXGEN_TEST_FAULT_RID": "poison", "RADIXGEN_TEST_FAULT_AT": str(AT_TOKEN)}
    s = ServerProc("--max-total-tokens", "4096", "--log-level", "warning", "--dtype", "float32", env=env)  # exact equality
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


def test_injected_fault_fails_only_that_request(server):
    with server.client(timeout=120) as c:
        ref = c.post("/generate", json={"text": PROMPTS, "sampling_params": SP})  # without the poisoned one
        assert ref.status_code == 200, ref.text[:300]
        expected = [o["output_ids"] for o in ref.json()]
        wait_idle(c)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            poisoned = client.post(
                "/generate", json={"text": "Tell me a story", "rid": "poison", "sampling_params": SP}
            )
            others = [client.post("/generate", json={"text": p, "rid": f"ok{i}", "sampling_params": SP})
                      for i, p in enumerate(PROMPTS)]  # fmt: skip
            return await asyncio.gather(poisoned, *others)

    bad, *good = asyncio.run(run())
    assert bad.status_code == 200, bad.text[:300]
    meta = bad.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"].startswith(REASON), (
        meta
    )
    assert meta["completion_tokens"] == AT_TOKEN, meta  # it failed at its third token, in a decode step
    assert [r.status_code for r in good] == [200] * 8
    assert [r.json()["meta_info"]["finish_reason"]["type"] for r in good] == ["length"] * 8
    assert [r.json()["output_ids"] for r in good] == expected
    assert "internal error while processing request poison" in server.output
    assert "Traceback" in server.output
    with server.client() as c:
        wait_idle(c)
        assert c.get("/health_generate").status_code == 200
        r = c.post(
            "/generate",
            json={"text": "Tell me a story", "rid": "poison", "stream": True, "sampling_params": SP},
        )
        assert r.status_code == 200  # streamed: the same abort arrives as the final event, then [DONE]
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and REASON in events[-2], events[-3:]
        r = c.post("/generate", json={"text": PROMPTS[0], "rid": "after", "sampling_params": SP})
        assert r.status_code == 200 and r.json()["output_ids"] == expected[0]
        wait_idle(c)


def test_last_scheduler_sigkill_stops_server_within_5s(server):
    """Must stay last: it ends the module's server."""
    sigkill_child_stops_tree(server, "rg-scheduler")
