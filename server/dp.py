"""`radixgen serve --dp-size N`: N worker servers on this machine behind sglang-router, one supervised group.

Order: find the router executable (missing: one line, exit 1) -> start N workers (`python -m server serve`
with the same flags, `--dp-size 1`, 127.0.0.1 and a free port each, `--num-threads` split) -> wait until each
answers `/health` 200 -> start `sglang-router launch` on --host/--port in front of them (server/router.py) ->
wait until it lists every worker healthy -> print `radixgen ready on http://HOST:PORT`.

On CUDA worker i gets GPU i mod G (CUDA_VISIBLE_DEVICES); workers sharing a GPU split --mem-fraction-static.

Supervision, as `radixgen serve` does for its scheduler and detokenizer (runtime/launch.py): the supervisor is
a child subreaper; each child gets PR_SET_PDEATHSIG (SIGTERM) and its own session (a terminal's Ctrl-C reaches
only the supervisor), and its output is relayed line by line prefixed `[worker i]` / `[router]`. A child that
exits, while starting or later, stops the server with exit 1 and a message naming it (worker i with its pid
and port, or the router). SIGTERM/SIGINT stop every child (SIGTERM, SIGKILL after a grace period), exit 0.
Every descendant is reaped before the exit status is observable.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO

import httpx

from runtime.config import Config
from runtime.launch import describe_exit, reap_children
from server.config_flags import config_flags
from server.router import RouterNotFound, find_router, router_command

logger = logging.getLogger("radixgen.dp")
STOP_GRACE_S = 10.0


class ChildDied(RuntimeError):
    """A supervised child exited; the message names it."""


class Stopped(RuntimeError):
    """A signal asked the group to stop while it was starting."""


def threads_per_group(total: int | None, groups: int) -> int:
    """torch threads of one worker group: the machine's (or --num-threads') total split evenly, at least 1."""
    return max(1, (total or os.cpu_count() or 1) // groups)


def gpu_plan(workers: int, visible: list[str]) -> list[tuple[str | None, float]]:
    """Per worker: (its CUDA_VISIBLE_DEVICES, the share of that GPU's --mem-fraction-static it may use).
    Worker i gets GPU visible[i % G]; workers sharing a GPU split its memory budget evenly. No GPU: (None, 1)."""
    if not visible:
        return [(None, 1.0)] * workers
    on = [sum(1 for j in range(workers) if j % len(visible) == g) for g in range(len(visible))]
    return [(visible[i % len(visible)], 1.0 / on[i % len(visible)]) for i in range(workers)]


def visible_gpus(cfg: Config) -> list[str]:
    """The CUDA devices the workers may use (none when running on CPU)."""
    if cfg.model.device == "cpu":
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in listed.split(",") if x.strip()] if listed else []
    return ids or [str(i) for i in range(torch.cuda.device_count())]


def worker_config(cfg: Config, port: int, groups: int, gpu_share: float = 1.0) -> Config:
    """The config of one worker server: one group on 127.0.0.1:port with its share of the threads (and of
    its GPU's memory budget when it shares the GPU)."""
    model = replace(cfg.model, num_threads=threads_per_group(cfg.model.num_threads, groups),
                    mem_fraction_static=cfg.model.mem_fraction_static * gpu_share)
    server = replace(cfg.server, host="127.0.0.1", port=port)
    return replace(cfg, model=model, server=server, parallel=replace(cfg.parallel, dp_size=1))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """Runs in the child between fork and exec (so only a preloaded libc call): PR_SET_PDEATHSIG."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM, 0, 0, 0)


@dataclass
class Child:
    name: str  # "worker 0", ..., "router"
    proc: subprocess.Popen
    url: str

    def describe(self) -> str:
        return f"the {self.name} process (pid {self.proc.pid}, {self.url}) {describe_exit(self.proc.poll())}"


def _relay(stream: IO[str], prefix: str) -> None:
    for line in stream:
        sys.stdout.write(f"[{prefix}] {line}")
        sys.stdout.flush()


class DataParallelGroup:
    """The worker servers and the router of one `--dp-size N` launch."""

    def __init__(self, cfg: Config, router: str) -> None:
        self.cfg = cfg
        self.router_executable = router
        self.children: list[Child] = []
        self.stop_requested = threading.Event()

    def _spawn(self, name: str, argv: list[str], url: str, env: dict[str, str] | None = None) -> Child:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=_die_with_parent, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        assert proc.stdout is not None
        threading.Thread(target=_relay, args=(proc.stdout, name), name=f"relay-{name}", daemon=True).start()
        child = Child(name, proc, url)
        self.children.append(child)
        logger.info("started the %s process (pid %d, %s)", name, proc.pid, url)
        return child

    def check(self) -> None:
        """Raise ChildDied naming the first child that exited, Stopped after a signal."""
        for c in self.children:
            if c.proc.poll() is not None:
                raise ChildDied(c.describe())
        if self.stop_requested.is_set():
            raise Stopped("stopped while starting")

    def _wait(self, what: str, timeout: float, ready: Callable[[httpx.Client], bool]) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                self.check()
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                    if ready(client):
                        return
                if time.monotonic() > deadline:
                    raise ChildDied(f"timed out after {timeout:g} s waiting for {what}")
                time.sleep(0.2)

    def start(self) -> None:
        n = self.cfg.parallel.dp_size
        for i, (gpu, share) in enumerate(gpu_plan(n, visible_gpus(self.cfg))):
            port = free_port()
            flags = config_flags(worker_config(self.cfg, port, n, share))
            env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
            self._spawn(f"worker {i}", [sys.executable, "-m", "server", "serve", *flags], f"http://127.0.0.1:{port}",
                        env)
        workers = list(self.children)
        self._wait("the workers to start", self.cfg.server.startup_timeout,
                   lambda c: all(c.get(w.url + "/health").status_code == 200 for w in workers))
        srv = self.cfg.server
        argv = router_command(self.router_executable, srv.host, srv.port, [w.url for w in workers],
                              self.cfg.parallel.router_policy, free_port(), srv.log_level)
        router = self._spawn("router", argv, f"http://{srv.host}:{srv.port}")
        urls = {w.url for w in workers}
        probe = router.url.replace("://0.0.0.0:", "://127.0.0.1:")

        def registered(c: httpx.Client) -> bool:
            listed = c.get(probe + "/workers").json()["workers"]
            return urls <= {w["url"] for w in listed if w["is_healthy"]}

        self._wait("sglang-router to register the workers", 120.0, registered)

    def supervise(self) -> str | None:
        """Block until a child exits (its description) or a stop is requested (None)."""
        while not self.stop_requested.wait(0.2):
            for c in self.children:
                if c.proc.poll() is not None:
                    return c.describe()
        return None

    def shutdown(self) -> None:
        """SIGTERM every running child (the router first), SIGKILL what is left after the grace period."""
        alive = [c for c in reversed(self.children) if c.proc.poll() is None]
        for c in alive:
            with contextlib.suppress(OSError):
                c.proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S + self.cfg.server.shutdown_timeout
        for c in alive:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("the %s process did not stop in time: killing it", c.name)
                c.proc.kill()
                c.proc.wait(5)


def run_dp(cfg: Config) -> int:
    """Run `--dp-size N` until a signal (exit 0) or a child's death or a start-up failure (exit 1)."""
    from runtime.launch import become_subreaper

    logging.basicConfig(level=cfg.server.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if cfg.server.api_key:
        logger.error("--api-key with --dp-size is not supported: sglang-router does not pass clients' keys on")
        return 1
    try:
        router = find_router(cfg.parallel.router_binary)
    except RouterNotFound as e:
        logger.error("--dp-size %d needs sglang-router: %s", cfg.parallel.dp_size, e)
        return 1
    become_subreaper()
    group = DataParallelGroup(cfg, router)

    def on_signal(sig: int, frame: object) -> None:
        logger.info("%s received: shutting down", signal.Signals(sig).name)
        group.stop_requested.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            group.start()
        except Stopped:
            return 0
        except (ChildDied, OSError, ValueError) as e:
            logger.error("startup failed: %s", e)
            return 1
        srv = cfg.server
        print(f"radixgen ready on http://{srv.host}:{srv.port} (sglang-router {cfg.parallel.router_policy}, "
              f"{cfg.parallel.dp_size} workers)", flush=True)
        died = group.supervise()
        if died is not None:
            logger.error("%s; stopping the server", died)
            return 1
        return 0
    finally:
        group.shutdown()
        reap_children()
        for s, h in previous.items():
            signal.signal(s, h)
