"""Process supervision with a model-free scheduler: child death, signals, startup failure, overload."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from tests.server.harness import ServerProc, alive, descendants


def _children(server) -> dict[str, int]:
    """{'scheduler': pid, 'detokenizer': pid}: children name themselves (/proc/PID/comm)."""
    out = {}
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm.startswith("rg-"):
            out[comm.removeprefix("rg-")] = pid
    return out


def _wait_exit(server, timeout: float) -> float:
    t0 = time.monotonic()
    server.proc.wait(timeout)
    return time.monotonic() - t0


def _all_gone(pids, timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _first_health_status(server, timeout: float = 60.0) -> int:
    """The status of the first /health answer once the port is bound (the children are still loading)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with httpx.Client(base_url=server.url, timeout=5) as c:
                return c.get("/health").status_code
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("the port never opened")


def test_health_503_until_ready_then_sigkill_of_scheduler_stops_server_without_orphans(server_factory):
    server = server_factory(fake=True)
    assert _first_health_status(server) == 503  # bound before the tokenizer and children are loaded
    server.wait_ready()
    with server.client() as c:
        assert c.get("/health").status_code == 200
    tree = descendants(server.proc.pid)
    kids = _children(server)
    assert set(kids) == {"scheduler", "detokenizer"}, (kids, server.output)
    t0 = time.monotonic()
    os.kill(kids["scheduler"], signal.SIGKILL)
    server.proc.wait(5)
    assert time.monotonic() - t0 < 5
    assert server.proc.returncode == 1
    assert "the scheduler process was killed by signal SIGKILL" in server.output
    assert _all_gone(tree | {server.proc.pid}) == []


def test_sigterm_exits_zero_quickly_with_requests_in_flight(server_factory):
    server = server_factory(fake=True).wait_ready()
    tree = descendants(server.proc.pid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        def long_request():
            with server.client() as c:
                return c.post("/generate", json={"text": "x y z", "sampling_params": {"max_new_tokens": 1500}})

        futs = [pool.submit(long_request) for _ in range(4)]
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        elapsed = _wait_exit(server, 5)
        statuses = [f.result().status_code for f in futs]
    assert elapsed < 5
    assert server.proc.returncode == 0, server.output
    assert all(s == 503 for s in statuses), statuses
    assert _all_gone(tree) == []


def test_startup_failure_is_reported_and_exits_nonzero(server_factory):
    server = server_factory(env={"RADIXGEN_SCHEDULER_FACTORY": "tests.server.fake_scheduler:create_broken"})
    server.proc.wait(120)
    assert server.proc.returncode == 1
    assert "the scheduler process failed to start: RuntimeError: no model here" in server.output


KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def guarded():
    """One fake-scheduler server with an API key, metric names under --metrics-prefix and a tiny queue bound."""
    s = ServerProc("--max-running-requests", "1", "--max-queued-requests", "1", "--api-key", "sekrit",
                   "--metrics-prefix", "radixgen", fake=True)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_api_key_required_except_on_health_and_metrics(guarded):
    with guarded.client() as c:
        r = c.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.get("/get_server_info", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200
        assert c.get("/metrics").status_code == 200
        r = c.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 2}}, headers=KEY)
        assert r.status_code == 200 and r.json()["text"] == "a b"
        assert "api_key" not in c.get("/get_server_info", headers=KEY).json()


def test_metrics_prefix_switches_the_names(guarded):
    with guarded.client() as c:
        text = c.get("/metrics").text
    assert "radixgen:num_running_reqs{" in text and "radixgen:generation_tokens_total{" in text
    assert "sglang:" not in text


def test_a_request_that_fails_in_the_scheduler_aborts_only_itself(guarded):
    with guarded.client(headers=KEY) as c:
        r = c.post("/generate", json={"input_ids": [13, 13, 13], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        fr = r.json()["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and "boom" in fr["message"]
        assert c.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_waiting_queue_bound_gives_503_with_retry_after(guarded):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        def long_request():
            with guarded.client(headers=KEY) as c:
                return c.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 300}})

        futs = [pool.submit(long_request) for _ in range(2)]
        time.sleep(0.5)
        with guarded.client(headers=KEY) as c:
            r = c.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
        assert [f.result().status_code for f in futs] == [200, 200]


def test_last_sigint_is_a_clean_exit(guarded):
    """Must stay last: it ends the module's guarded server."""
    tree = descendants(guarded.proc.pid)
    guarded.proc.send_signal(signal.SIGINT)
    assert _wait_exit(guarded, 5) < 5
    assert guarded.proc.returncode == 0
    assert _all_gone(tree) == []


@pytest.mark.parametrize("how", ["kill-scheduler", "SIGTERM", "SIGINT"])
def test_no_process_of_the_tree_alive_when_the_exit_status_is_observable(server_factory, how):
    """The supervisor reaps every descendant before it exits: checked right when waitpid returns, no sleep."""
    server = server_factory(fake=True).wait_ready()
    tree = descendants(server.proc.pid)  # scheduler, detokenizer, multiprocessing's resource tracker
    kids = _children(server)
    assert set(kids) == {"scheduler", "detokenizer"}, (kids, server.output)
    if how == "kill-scheduler":
        os.kill(kids["scheduler"], signal.SIGKILL)
    else:
        server.proc.send_signal(getattr(signal, how))
    server.proc.wait(15)  # waitpid: the exit status is observable from here on
    left = [p for p in tree if alive(p)]
    assert left == [], (left, server.output)
    assert server.proc.returncode == (1 if how == "kill-scheduler" else 0)
