"""An sglang-router process for tests: started on 127.0.0.1 (free ports) in front of given worker URLs, its
output collected, waited for until every worker is registered and healthy (bounded), always killed by PID."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Sequence

import httpx

from server.router import find_router, router_command
from tests.server.harness import free_port, stop_tree


class RouterProc:
    def __init__(self, worker_urls: Sequence[str], policy: str = "cache_aware", **kw: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = list(worker_urls)
        argv = router_command(find_router(), "127.0.0.1", self.port, self.workers, policy, free_port(), **kw)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)

    def wait_registered(self, timeout: float = 60.0) -> RouterProc:
        """Until /workers lists every worker URL as healthy and /get_model_info proxies (else raise)."""
        deadline = time.monotonic() + timeout
        with self.client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    workers = c.get("/workers").json()["workers"]
                    healthy = {w["url"] for w in workers if w["is_healthy"]}
                    if healthy >= set(self.workers) and c.get("/get_model_info").status_code == 200:
                        return self
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router did not register {self.workers}:\n{self.output[-4000:]}")

    def stop(self) -> None:
        stop_tree(self.proc)
