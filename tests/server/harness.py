"""Helpers for end-to-end server tests: real `python -m server serve` processes on 127.0.0.1.

`ServerProc` starts one on a free port, collects its output in a thread, waits for the ready line, lists
its process tree by pid (from /proc), and always stops it (SIGTERM, then SIGKILL of the whole tree).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = "tests.server.fake_scheduler:create"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ppid_map() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                out[int(d)] = int(fields[1])
    return out


def descendants(pid: int) -> set[int]:
    ppid = _ppid_map()
    found, frontier = set(), {pid}
    while frontier:
        nxt = {p for p, pp in ppid.items() if pp in frontier} - found
        found |= nxt
        frontier = nxt
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM `proc` (SIGKILL after 10 s), then SIGKILL whatever of its process tree is left."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class ServerProc:
    def __init__(self, *args: str, fake: bool = False, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if fake:
            full_env["RADIXGEN_SCHEDULER_FACTORY"] = FAKE
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("radixgen ready on"):
                self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 180.0) -> ServerProc:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become ready:\n{self.output[-4000:]}")
        return self

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)

    def stop(self) -> None:
        stop_tree(self.proc)


