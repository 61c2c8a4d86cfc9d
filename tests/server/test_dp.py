"""`radixgen serve --dp-size N`: N worker servers behind sglang-router, supervised as one group.

End to end on the echo scheduler (tests/server/fake_scheduler.py): requests through the router's port, the
process tree, SIGTERM stopping everything, a killed worker or router stopping the server with a message that
names it, no process left behind; the missing-router refusal; the config a worker gets."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from runtime.config import Config, make_config, resolve
from runtime.launch import Launch
from server.cli import build_parser, config_from_args
from server.config_flags import config_flags
from server.dp import gpu_plan, threads_per_group, worker_config
from tests.server.harness import ROOT, ServerProc, alive, descendants

pytest.importorskip("sglang_router")


def _children(pid: int) -> dict[str, int]:
    """{'worker i' | 'router': pid} of the supervisor's direct children, from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out[cmd] = int(d)
    return out


def _start() -> tuple[ServerProc, dict[str, int]]:
    s = ServerProc("--dp-size", "2", "--num-threads", "2", "--log-level", "warning", fake=True).wait_ready()
    ports = dict(re.findall(r"\[(worker \d)\] radixgen ready on http://127.0.0.1:(\d+)", s.output))
    cmds = _children(s.proc.pid)
    named = {"router": next(p for c, p in cmds.items() if "server serve" not in c)}
    for name, port in ports.items():
        named[name] = next(p for c, p in cmds.items() if f"--port {port}" in c)
    assert sorted(named) == ["router", "worker 0", "worker 1"], (cmds, s.output[-2000:])
    return s, {**named, **{f"{n} port": int(p) for n, p in ports.items()}}


def _exit(s: ServerProc, timeout: float = 30.0) -> int:
    try:
        return s.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        s.stop()
        raise AssertionError(f"the supervisor did not exit:\n{s.output[-3000:]}") from None


def test_serves_through_the_router_and_sigterm_stops_every_process():
    s, pids = _start()
    try:
        tree = descendants(s.proc.pid)
        assert len(tree) >= 7  # router + 2 x (worker server, scheduler, detokenizer)
        with s.client() as c:
            r = c.post("/generate", json={"text": "Hello world", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200 and r.json()["text"] == "Hello world"
            workers = c.get("/workers").json()["workers"]
            assert sorted(w["url"] for w in workers) == sorted(
                f"http://127.0.0.1:{pids[f'worker {i} port']}" for i in range(2))
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200
        for i in range(2):  # each group got its half of --num-threads 2
            info = httpx.get(f"http://127.0.0.1:{pids[f'worker {i} port']}/get_server_info").json()
            assert info["num_threads"] == 1 and info["dp_size"] == 1
        s.proc.send_signal(signal.SIGTERM)
        assert _exit(s) == 0
        assert not [p for p in tree if alive(p)]
    finally:
        s.stop()


@pytest.mark.parametrize("victim", ["worker 1", "router"])
def test_a_dead_child_stops_the_server_naming_it(victim):
    s, pids = _start()
    try:
        tree = descendants(s.proc.pid)
        os.kill(pids[victim], signal.SIGKILL)
        assert _exit(s) == 1
        line = next(x for x in s.output.splitlines() if "stopping the server" in x)
        assert f"the {victim} process (pid {pids[victim]}," in line and "killed by signal SIGKILL" in line
        deadline = time.monotonic() + 5
        while [p for p in tree if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in tree if alive(p)]
    finally:
        s.stop()


def test_missing_router_is_one_clear_line():
    out = subprocess.run([sys.executable, "-m", "server", "serve", "--dp-size", "2", "--router-binary",
                          "/nonexistent/sglang-router", "--port", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "--dp-size 2 needs sglang-router" in lines[0] and "/nonexistent" in lines[0], lines


def test_worker_config_and_flags_round_trip():
    cfg = make_config(dp_size=3, num_threads=8, port=8000, host="0.0.0.0", max_total_tokens=512,
                      disable_radix_cache=True, enable_metrics=False, router_policy="round_robin",
                      served_model_name="m", shutdown_timeout=2.5)
    w = worker_config(cfg, 4321, 3)
    assert (w.parallel.dp_size, w.model.num_threads, w.server.host, w.server.port) == (1, 2, "127.0.0.1", 4321)
    assert w.cache == cfg.cache and w.scheduler == cfg.scheduler and w.model.served_model_name == "m"
    for c in (cfg, w, Config()):
        assert config_from_args(build_parser().parse_args(["serve", *config_flags(c)])) == c
    assert config_flags(Config()) == []
    assert threads_per_group(None, 1) == (os.cpu_count() or 1)
    assert threads_per_group(5, 2) == 2 and threads_per_group(1, 4) == 1


def test_dp_size_is_a_serve_option():
    with pytest.raises(ValueError, match="radixgen serve"):
        Launch(make_config(dp_size=2))
    with pytest.raises(ValueError, match="at least 1"):
        resolve(make_config(dp_size=0))


def test_gpu_plan_one_gpu_per_worker_or_a_shared_budget():
    assert gpu_plan(2, []) == [(None, 1.0), (None, 1.0)]
    assert gpu_plan(2, ["4", "5"]) == [("4", 1.0), ("5", 1.0)]
    assert gpu_plan(3, ["0", "1"]) == [("0", 0.5), ("1", 1.0), ("0", 0.5)]
    assert gpu_plan(2, ["0"]) == [("0", 0.5), ("0", 0.5)]
    cfg = make_config(dp_size=2, mem_fraction_static=0.8)
    assert worker_config(cfg, 1, 2, 0.5).model.mem_fraction_static == pytest.approx(0.4)
