"""Which decode buckets run compiled, and how they get there (--compile-mode background or sync).

Both modes go through the artifact cache (runtime/executor/artifact_cache.py) of AOTInductor packages
(runtime/executor/aot_graph.py): a bucket whose entry verifies is loaded at once (~0.2 s), so a restart with
the same key serves compiled from its first decode step.
  sync:        missing buckets compile in this process before the server is ready.
  background:  missing buckets compile in a nice-19 child process (runtime/executor/compile_worker.py) while
               this one serves eagerly; `poll()` runs at a step boundary (the start of a forward), at most
               every POLL_S, and loads each bucket whose entry has appeared.
If the child exits before every bucket is ready, the rest stay eager: one warning and a `compiled_decode`
fallbacks entry (kernels/fallbacks.py), reported through `state()`.

Data flow: state() -> the scheduler's internal state -> /get_server_info and /metrics.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kernels import fallbacks
from runtime.executor import aot_graph
from runtime.executor.artifact_cache import MANIFEST, ArtifactCache
from runtime.executor.cuda_graph import DecodeGraphRunner

log = logging.getLogger(__name__)
POLL_S = 0.5


class CompileManager:
    def __init__(self, graphs: DecodeGraphRunner, mode: str, cache: ArtifactCache, key_base: dict[str, Any],
                 worker_job: dict[str, Any]) -> None:
        self.graphs, self.mode, self.cache, self.key_base = graphs, mode, cache, key_base
        self.worker_job = worker_job  # model fields and backend id for the child
        self.pending = list(graphs.buckets)
        self.proc: subprocess.Popen[bytes] | None = None
        self.failed = ""
        self.compiled_here: dict[int, float] = {}  # bucket -> seconds (sync mode)
        self.t_start = time.monotonic()
        self.ready_after: dict[int, float] = {}  # bucket -> seconds from start until it was swapped in
        self._last_poll = 0.0

    def key(self, bs: int) -> dict[str, Any]:
        return aot_graph.graph_key(self.key_base, bs)

    def start(self) -> None:
        """Load every cached bucket; then compile the rest here (sync) or start the child (background)."""
        for bs in list(self.pending):
            self._try_load(bs)
        if not self.pending:
            log.info("compiled decode graphs for batch sizes %s loaded from %s", self._names(), self.cache.root)
            return
        if self.mode == "sync":
            for bs in list(self.pending):
                with tempfile.TemporaryDirectory(dir=self._tmp_parent()) as tmp:
                    out = Path(tmp) / "graph.pt2"
                    self.compiled_here[bs] = aot_graph.compile_package(self.graphs, bs, out)
                    self.cache.store(self.key(bs), out)
                self._try_load(bs)
            log.info("compiled decode graphs for batch sizes %s (%s)", self._names(),
                     ", ".join(f"{b}: {s:.1f} s" for b, s in self.compiled_here.items()))
            return
        self._spawn()

    def _tmp_parent(self) -> str:
        self.cache.root.mkdir(parents=True, exist_ok=True)
        return str(self.cache.root)

    def _spawn(self) -> None:
        job = {**self.worker_job, "buckets": self.pending, "key_base": self.key_base,
               "cache_root": str(self.cache.root), "cache_max_bytes": self.cache.max_bytes}
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.executor.compile_worker"],
                                     stdin=subprocess.PIPE)  # its per-bucket lines go to our log
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode())
        self.proc.stdin.close()
        log.info("serving eagerly; compiling decode graphs for batch sizes %s in the background (pid %d)",
                 ",".join(map(str, self.pending)), self.proc.pid)

    def poll(self, force: bool = False) -> None:
        """At a step boundary: swap in every bucket whose package appeared; notice a dead compiler."""
        if not self.pending or self.failed:
            return
        now = time.monotonic()
        if not force and now - self._last_poll < POLL_S:
            return
        self._last_poll = now
        exited = self.proc.poll() if self.proc is not None else None
        for bs in list(self.pending):
            if (self.cache.entry_dir(self.key(bs)) / MANIFEST).exists():
                self._try_load(bs)
        if not self.pending:
            log.info("all decode buckets compiled (%s) after %.1f s", self._names(), now - self.t_start)
        elif exited is not None:
            self.failed = (f"the background compile process exited (code {exited}) before batch sizes "
                           f"{','.join(map(str, self.pending))} were compiled: those decode eagerly (slower)")
            fallbacks.record("compiled_decode", self.failed)

    def _try_load(self, bs: int) -> None:
        pkg = self.cache.lookup(self.key(bs))
        if pkg is None:
            return
        try:
            self.graphs.add_graph(bs, aot_graph.PackagedGraph(pkg))
        except Exception as e:  # noqa: BLE001 (a package that does not load is one more cache miss)
            log.warning("compiled decode graph for batch size %d did not load (%s: %s); it will be recompiled",
                        bs, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.cache.rejected += 1
            return
        self.pending.remove(bs)
        self.ready_after[bs] = round(time.monotonic() - self.t_start, 1)
        log.info("decode batch size %d now runs compiled", bs)

    def _names(self) -> str:
        return ",".join(map(str, sorted(self.graphs.graphs)))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def state(self) -> dict[str, Any]:
        return {
            "compile_mode": self.mode,
            "compiled_buckets": sorted(self.graphs.graphs),
            "pending_buckets": sorted(self.pending),
            # published by the compiler, swapped in at the next decode step
            "ready_buckets": sorted(b for b in self.pending if (self.cache.entry_dir(self.key(b)) / MANIFEST).exists()),
            "compiled_replays": self.graphs.replays,
            "compile_ready_after_s": {str(b): s for b, s in sorted(self.ready_after.items())},
            "compile_worker_pid": self.proc.pid if self.proc is not None and self.proc.poll() is None else None,
            "compile_cache": {"root": str(self.cache.root), "hits": self.cache.hits, "misses": self.cache.misses,
                              "rejected": self.cache.rejected},
            "compile_failed": self.failed,
        }
