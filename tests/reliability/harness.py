"""Shared helpers for the reliability battery: the scheduler's idle KV invariant read over HTTP, and a child
process killed to check that the whole tree goes down.

Servers are started with `tests.server.harness.ServerProc` (free port on 127.0.0.1, whole tree stopped).
"""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.server.harness import ServerProc, alive, descendants


def internal(c: httpx.Client) -> dict:
    r = c.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def idle_and_no_leak(st: dict) -> bool:
    """Nothing running or waiting, and every KV slot is free or evictable (SGLang's idle leak check)."""
    return (
        st["num_running_reqs"] == 0
        and st["num_waiting_reqs"] == 0
        and st["kv_locked_slots"] == 0
        and st["kv_free_slots"] + st["kv_evictable_slots"] == st["max_total_num_tokens"]
    )


def wait_idle(c: httpx.Client, timeout: float = 10.0) -> dict:
    """The internal state once idle with no leak, or the last one seen after `timeout` (asserted)."""
    deadline = time.monotonic() + timeout
    while not idle_and_no_leak(st := internal(c)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle_and_no_leak(st), st
    return st


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def sigkill_child_stops_tree(server: ServerProc, comm: str) -> None:
    """SIGKILL the one child named `comm` (e.g. rg-scheduler); the server exits with status 1 within 5 s and no
    process of its tree outlives it by more than 3 s."""
    tree = descendants(server.proc.pid)
    child = [p for p in tree if _comm(p) == comm]
    assert len(child) == 1, child
    t0 = time.monotonic()
    os.kill(child[0], signal.SIGKILL)
    server.proc.wait(5)
    assert time.monotonic() - t0 < 5
    assert server.proc.returncode == 1
    deadline = time.monotonic() + 3
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in tree if alive(p)] == []
