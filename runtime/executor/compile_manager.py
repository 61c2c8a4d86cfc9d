"""Which decode buckets run compiled, and how they get there (--compile-mode background or sync).

Both modes go through the artifact cache (runtime/executor/artifact_cache.py) of compiled graphs
(runtime/executor/aot_graph.py, graph_package.py). One graph serves a group of buckets (aot_graph.bucket_groups:
1,2,4 and 8,16,32 by default), one cache entry per group: a group whose entry verifies and binds to the live
model's weights is loaded, not compiled, and each of its buckets swaps in.
  sync:        cached buckets load and missing ones compile in this process before the server is ready.
  background:  nothing blocks readiness. Cached groups (an entry's manifest exists) are verified and loaded
               by a loader thread, smallest first, while the server already serves eagerly; missing groups
               compile in a nice-19 child process (runtime/executor/compile_worker.py). `poll()` runs at a
               step boundary (the start of a forward), at most every POLL_S: it swaps in each group the
               thread has loaded and loads each one the child has published. An entry that fails to verify
               or load is recompiled by a child started once the thread is done.
Only `poll()` (the scheduler's thread) touches the decode runner: the loader thread hands over loaded
libraries through a queue, and each bucket's first replay runs in `poll()`.
If the child exits before every bucket is ready, the rest stay eager: one warning and a `compiled_decode`
fallbacks entry (kernels/fallbacks.py), reported through `state()`.

Data flow: state() -> the scheduler's internal state -> /get_server_info and /metrics.
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kernels import fallbacks
from runtime.executor import aot_graph, graph_package
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
        self.groups = aot_graph.bucket_groups(graphs.buckets, aot_graph.row_thresholds(graphs.model))
        self.proc: subprocess.Popen[bytes] | None = None
        self.compiling: list[tuple[int, ...]] = []  # groups handed to the child
        self.failed = ""
        self.compiled_here: dict[tuple[int, ...], float] = {}  # group -> seconds (sync mode)
        self.t_start = time.monotonic()
        self.ready_after: dict[int, float] = {}  # bucket -> seconds from start until it was swapped in
        self._last_poll = 0.0
        # (group, library) from the thread
        self._loaded: queue.SimpleQueue[tuple[tuple[int, ...], Any]] = queue.SimpleQueue()
        self._retry: list[tuple[int, ...]] = []  # groups whose entry the thread rejected: for the child
        self._loader: threading.Thread | None = None

    def weights(self, group: tuple[int, ...]) -> str:
        return aot_graph.weights_mode(self.graphs.model, group)

    def key(self, group: tuple[int, ...]) -> dict[str, Any]:
        return aot_graph.graph_key(self.key_base, group, self.weights(group))

    def _published(self, group: tuple[int, ...]) -> bool:
        return (self.cache.entry_dir(self.key(group)) / MANIFEST).exists()

    def start(self) -> None:
        """sync: load every cached group and compile the rest here. background: start the loader thread for
        the cached groups and the child for the rest, and return at once."""
        if self.mode == "sync":
            for g in self.groups:
                self._add(g, self._load(g))
            for g in [g for g in self.groups if g[0] in self.pending]:
                with tempfile.TemporaryDirectory(dir=self._tmp_parent()) as tmp:
                    out = Path(tmp) / "graph.so"
                    self.compiled_here[g], table = aot_graph.compile_package(self.graphs, g, out, self.weights(g))
                    self.cache.store(self.key(g), out, table)
                self._add(g, self._load(g))
            log.info("decode graphs for batch sizes %s ready (compiled here: %s)", self._names(),
                     ", ".join(f"{_label(g)}: {s:.1f} s" for g, s in self.compiled_here.items()) or "none")
            return
        cached = [g for g in self.groups if self._published(g)]
        missing = [g for g in self.groups if g not in cached]
        if missing:
            self._spawn(missing)
        if cached:
            self._loader = threading.Thread(target=self._load_cached, args=(cached,), name="graph-loader",
                                            daemon=True)
            self._loader.start()

    def _load_cached(self, groups: list[tuple[int, ...]]) -> None:
        """The loader thread: verify and load each cached group, smallest first, for `poll()` to swap in."""
        for g in groups:
            lib = self._load(g)
            if lib is None:
                self._retry.append(g)
            else:
                self._loaded.put((g, lib))

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until the loader thread is done, then swap in what it loaded (tests; a bench's steady state)."""
        if self._loader is not None:
            self._loader.join(timeout)
        self.poll(force=True)

    def _tmp_parent(self) -> str:
        self.cache.root.mkdir(parents=True, exist_ok=True)
        return str(self.cache.root)

    def _spawn(self, groups: list[tuple[int, ...]]) -> None:
        job = {**self.worker_job, "groups": [[list(g), self.weights(g)] for g in groups], "key_base": self.key_base,
               "cache_root": str(self.cache.root), "cache_max_bytes": self.cache.max_bytes}
        self.compiling = list(groups)
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.executor.compile_worker"],
                                     stdin=subprocess.PIPE)  # its per-bucket lines go to our log
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode())
        self.proc.stdin.close()
        log.info("serving eagerly; compiling decode graphs for batch sizes %s in the background (pid %d)",
                 " ".join(map(_label, groups)), self.proc.pid)

    def poll(self, force: bool = False) -> None:
        """At a step boundary: swap in every bucket loaded or published since the last poll; notice a dead
        compiler."""
        if not self.pending or self.failed:
            return
        now = time.monotonic()
        if not force and now - self._last_poll < POLL_S:
            return
        self._last_poll = now
        while not self._loaded.empty():
            g, lib = self._loaded.get()
            self._add(g, lib)
        exited = self.proc.poll() if self.proc is not None else None
        for g in [g for g in self.compiling if g[0] in self.pending]:
            if self._published(g):
                self._add(g, self._load(g))
        loader_done = self._loader is None or not self._loader.is_alive()
        if loader_done and self._retry and (self.proc is None or exited is not None):
            retry, self._retry = self._retry, []
            self._spawn(retry)
            return
        if not self.pending:
            log.info("all decode buckets compiled (%s) after %.1f s", self._names(), now - self.t_start)
        elif exited is not None and any(g[0] in self.pending for g in self.compiling):
            self.failed = (f"the background compile process exited (code {exited}) before batch sizes "
                           f"{','.join(map(str, self.pending))} were compiled: those decode eagerly (slower)")
            fallbacks.record("compiled_decode", self.failed)

    def _load(self, group: tuple[int, ...]) -> Any:
        """The verified library of `group`, loaded and bound to the live model's weights, or None (missing; or
        rejected and removed)."""
        key = self.key(group)
        found = self.cache.lookup_entry(key)
        if found is None:
            return None
        path, meta = found
        try:
            lib = graph_package.load_library(path)
            if key["weights"] == "bound":  # an entry without its table binds nothing and is rejected
                graph_package.bind_constants(lib, self.graphs.body, meta.get("constants") or [])
            return lib
        except Exception as e:  # noqa: BLE001 (a graph that does not load or bind is one more rejected entry)
            self.cache.discard(key, f"did not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return None

    def _add(self, group: tuple[int, ...], lib: Any) -> None:
        """Swap the buckets of `group` in (each one's first replay runs here); a None library leaves them
        pending."""
        if lib is None or not any(bs in self.pending for bs in group):
            return
        try:
            for bs in group:
                self.graphs.add_graph(bs, graph_package.PackagedGraph(lib))
        except Exception as e:  # noqa: BLE001 (a graph that does not run is rejected and recompiled)
            for bs in group:
                self.graphs.graphs.pop(bs, None)
            self.cache.discard(self.key(group), f"first run failed: {type(e).__name__}: "
                                                f"{str(e).splitlines()[0] if str(e) else ''}")
            if group not in self._retry:
                self._retry.append(group)
            return
        for bs in group:
            self.pending.remove(bs)
            self.ready_after[bs] = round(time.monotonic() - self.t_start, 1)
        log.info("decode batch sizes %s now run compiled", _label(group))

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
            "ready_buckets": sorted(b for g in self.groups if self._published(g) for b in g if b in self.pending),
            "compiled_replays": self.graphs.replays,
            "compile_ready_after_s": {str(b): s for b, s in sorted(self.ready_after.items())},
            "compile_worker_pid": self.proc.pid if self.proc is not None and self.proc.poll() is None else None,
            "compile_cache": {"root": str(self.cache.root), "hits": self.cache.hits, "misses": self.cache.misses,
                              "rejected": self.cache.rejected},
            "compile_failed": self.failed,
        }


def _label(group: tuple[int, ...]) -> str:
    return ",".join(map(str, group))
