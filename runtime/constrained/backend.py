"""GrammarBackend: compile constraints off the scheduler thread, in killable worker processes, with an LRU cache.

Threads and processes:
    scheduler thread --submit(kind, spec)--> job queue --> N worker threads (main process)
    each worker thread owns one subprocess (runtime/constrained/worker.py) and sends it one job at a time;
    it waits for the reply with select() until `grammar_compile_timeout`, and on timeout KILLS the process
    (SIGKILL: a runaway Rust DFA build cannot be interrupted any other way) and respawns it before the next
    job. So a catastrophic pattern costs one core for at most the timeout, and other grammars keep compiling
    on the other workers meanwhile.
What crosses the process boundary: msgpack frames of bytes/str/ints; the compiled Index comes back as
outlines-core's own binary serialization and is rebuilt with `Index.from_binary` (measured: a 300 KB index
serializes/deserializes in < 1 ms; a 111 MB one in well under a second), on the worker thread, not the
scheduler's.

Cache: key (kind, spec) -> CompiledGrammar or GrammarError (failures and timeouts are cached too), LRU-bounded
by `grammar_cache_size` entries and CACHE_MAX_BYTES of serialized index. Identical specs submitted while one
compiles share that compile.

Scheduler use (non-blocking):
    fut = backend.submit("json_schema", schema)       # at request arrival; req parked in the grammar queue
    each step: if fut.done(): g = fut.result(); Grammar -> req.grammar = g; GrammarError -> abort with g.message
    on abort: fut.cancel()
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from runtime.config import GrammarConfig
from runtime.constrained.grammar import CompiledGrammar, Grammar
from runtime.constrained.schema import KINDS
from runtime.constrained.schema import validate as _validate

logger = logging.getLogger(__name__)

CACHE_MAX_BYTES = 1 << 30  # serialized index bytes kept in the cache
WORKER_READY_TIMEOUT = 120.0  # seconds a fresh worker may take to import and build the vocabulary
_HEADER = struct.Struct(">I")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class GrammarError:
    """A failed compile: `message` names the problem; `code` is "invalid_value" or "grammar_too_complex"."""

    message: str
    code: str = "invalid_value"
    timed_out: bool = False


class GrammarFuture:
    """One request's handle on a compile. `result()` never blocks by default."""

    def __init__(self, job: _Job | None = None, outcome: CompiledGrammar | GrammarError | None = None) -> None:
        self._job = job
        self._outcome = outcome
        self._grammar: Grammar | GrammarError | None = None
        self.cancelled = False

    def done(self) -> bool:
        return self._outcome is not None or (self._job is not None and self._job.event.is_set())

    def result(self, timeout: float = 0.0) -> Grammar | GrammarError | None:
        """A fresh Grammar (the same object on every call), a GrammarError, or None if not done within
        `timeout` seconds (0 = poll)."""
        if self._grammar is not None:
            return self._grammar
        if self.cancelled:
            self._grammar = GrammarError("grammar compilation cancelled")
            return self._grammar
        if self._outcome is None:
            assert self._job is not None
            if not self._job.event.wait(timeout) if timeout else not self._job.event.is_set():
                return None
            self._outcome = self._job.outcome
        out = self._outcome
        self._grammar = out if isinstance(out, GrammarError) else out.new_state()
        return self._grammar

    def cancel(self) -> None:
        """Drop interest; a compile nobody waits for is skipped if it has not started."""
        if self.cancelled:
            return
        self.cancelled = True
        job = self._job
        if job is not None:
            with job.lock:
                if self in job.waiters:
                    job.waiters.remove(self)
                if not job.waiters and not job.started:
                    job.skip = True


class _Job:
    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.event = threading.Event()
        self.lock = threading.Lock()
        self.outcome: CompiledGrammar | GrammarError | None = None
        self.waiters: list[GrammarFuture] = []
        self.started = False
        self.skip = False


class _Worker:
    """One compile subprocess, driven by one thread of the backend."""

    def __init__(self, init_frame: bytes) -> None:
        self._init = init_frame
        self.proc: subprocess.Popen | None = None
        self.crashed = False

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.constrained.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, env=env, cwd=_REPO_ROOT)
        self.proc.stdin.write(self._init)
        self.proc.stdin.flush()
        ready = self._read(time.monotonic() + WORKER_READY_TIMEOUT)
        if ready is None or ready.get("op") != "ready":
            self.kill()
            raise RuntimeError("grammar compile worker failed to start")

    def _read(self, deadline: float) -> dict | None:
        """One frame, or None on timeout / EOF."""
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        need = _HEADER.size
        have_header = False
        while True:
            while len(buf) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
                chunk = os.read(fd, min(need - len(buf), 1 << 20))  # never past this frame
                if not chunk:
                    return None
                buf += chunk
            if have_header:
                return msgspec.msgpack.decode(bytes(buf[_HEADER.size:need]))
            need = _HEADER.size + _HEADER.unpack(bytes(buf[:_HEADER.size]))[0]
            have_header = True

    def compile(self, job_id: int, kind: str, spec: str, ws: str | None, timeout: float) -> dict | None:
        """The worker's reply, or None when it ran past `timeout` (the process is killed) or died (then
        `self.crashed` is set)."""
        self.crashed = False
        if self.proc is None or self.proc.poll() is not None:
            self._spawn()
        data = msgspec.msgpack.encode({"op": "compile", "id": job_id, "kind": kind, "spec": spec, "ws": ws})
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            return None
        reply = self._read(time.monotonic() + timeout)
        if reply is None:
            self.crashed = self.proc.poll() is not None
            self.kill()
        return reply

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    f.close()
            self.proc = None


class GrammarBackend:
    """Compiles regex / json_schema / choices constraints over one vocabulary. Thread-safe submit."""

    def __init__(self, vocab: Sequence[bytes | None], eos_ids: frozenset[int], cfg: GrammarConfig | None = None,
                 num_workers: int = 2) -> None:
        self.cfg = cfg or GrammarConfig()
        self.eos_ids = frozenset(eos_ids)
        if not self.eos_ids:
            raise ValueError("GrammarBackend needs at least one EOS id")
        self.vocab_size = len(vocab)
        clean = [None if (i in self.eos_ids or not b) else bytes(b) for i, b in enumerate(vocab)]
        self._single = {}
        self._first = [-1] * len(clean)
        for i, b in enumerate(clean):
            if b is not None:
                self._first[i] = b[0]
                if len(b) == 1:
                    self._single.setdefault(b[0], i)
        init = msgspec.msgpack.encode({"op": "init", "vocab": clean, "eos": min(self.eos_ids)})
        self._init_frame = _HEADER.pack(len(init)) + init
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], CompiledGrammar | GrammarError] = \
            collections.OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self._inflight: dict[tuple[str, str], _Job] = {}
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._times: collections.deque[float] = collections.deque(maxlen=2048)
        self._counts = collections.Counter()
        self._compile_time_total = 0.0
        self._next_id = 0
        self._closed = False
        self._workers = [_Worker(self._init_frame) for _ in range(max(1, num_workers))]
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True, name=f"grammar-{i}")
                         for i, w in enumerate(self._workers)]
        if self.cfg.grammar_backend != "none":
            for t in self._threads:
                t.start()

    @classmethod
    def from_tokenizer(cls, tok, cfg: GrammarConfig | None = None, num_workers: int = 2) -> GrammarBackend:  # noqa: ANN001
        """From runtime.tokenizer.Tokenizer: byte tokens, special tokens excluded, its EOS set."""
        special = frozenset(tok.special_ids)
        vocab = [None if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]
        return cls(vocab, frozenset(tok.eos_token_ids), cfg, num_workers)

    # ------------------------------------------------------------ public API

    def validate(self, kind: str, spec: str) -> None:
        """Cheap structural check (server process); raises GrammarValidationError (a ValueError)."""
        _validate(kind, spec, self.cfg.constrained_json_whitespace_pattern)

    def submit(self, kind: str, spec: str) -> GrammarFuture:
        key = (kind, spec)
        if self.cfg.grammar_backend == "none":
            return GrammarFuture(outcome=GrammarError("constrained decoding is disabled (--grammar-backend none)"))
        if kind not in KINDS:
            return GrammarFuture(outcome=GrammarError(f"unknown constraint kind {kind!r}"))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._counts["cache_hits"] += 1
                return GrammarFuture(outcome=hit)
            self._counts["cache_misses"] += 1
            job = self._inflight.get(key)
            if job is None or job.skip:
                job = _Job(key)
                self._inflight[key] = job
                self._queue.put(job)
            fut = GrammarFuture(job)
            with job.lock:
                job.waiters.append(fut)
                job.skip = False
            return fut

    def compile_blocking(self, kind: str, spec: str, timeout: float | None = None) -> Grammar | GrammarError:
        """submit() and wait (tests, benches, offline tools; never the scheduler thread)."""
        fut = self.submit(kind, spec)
        limit = timeout if timeout is not None else self.cfg.grammar_compile_timeout * 4 + WORKER_READY_TIMEOUT
        res = fut.result(timeout=limit)
        return res if res is not None else GrammarError("compile did not finish in time", timed_out=True)

    def stats(self) -> dict:
        with self._lock:
            times = sorted(self._times)
            c = self._counts
            return {
                "compile_count": c["compiled"] + c["failed"] + c["timeouts"],
                "compile_ok": c["compiled"], "compile_errors": c["failed"], "timeouts": c["timeouts"],
                "cache_hits": c["cache_hits"], "cache_misses": c["cache_misses"],
                "worker_restarts": c["worker_restarts"],
                "compile_time_total": self._compile_time_total,
                "compile_time_p50": _pct(times, 0.50), "compile_time_p99": _pct(times, 0.99),
                "compile_times": list(self._times),
                "cache_entries": len(self._cache), "cache_bytes": sum(self._sizes.values()),
                "inflight": len(self._inflight),
            }

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=self.cfg.grammar_compile_timeout + 5)
        for w in self._workers:
            w.kill()

    def __enter__(self) -> GrammarBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ worker threads

    def _run(self, worker: _Worker) -> None:
        try:
            worker._spawn()
        except Exception:  # noqa: BLE001 - retried at the first job
            logger.warning("grammar worker did not start; retrying on first job")
        while True:
            job = self._queue.get()
            if job is None or self._closed:
                worker.kill()
                return
            with job.lock:
                if job.skip:
                    with self._lock:
                        if self._inflight.get(job.key) is job:
                            del self._inflight[job.key]
                    continue
                job.started = True
            self._finish(job, self._compile(worker, job))

    def _compile(self, worker: _Worker, job: _Job) -> tuple[CompiledGrammar | GrammarError, int]:
        kind, spec = job.key
        timeout = self.cfg.grammar_compile_timeout
        t0 = time.perf_counter()
        self._next_id += 1
        try:
            reply = worker.compile(self._next_id, kind, spec, self.cfg.constrained_json_whitespace_pattern, timeout)
        except Exception as e:  # noqa: BLE001 - spawn failure
            return GrammarError(f"grammar compile worker failed: {e}"), 0
        wall = time.perf_counter() - t0
        with self._lock:
            self._times.append(wall)
            self._compile_time_total += wall
        if reply is None and worker.crashed:
            with self._lock:
                self._counts["failed"] += 1
                self._counts["worker_restarts"] += 1
            return GrammarError(f"grammar compile worker died compiling this {kind} (memory limit?)",
                                code="grammar_too_complex"), 0
        if reply is None:
            with self._lock:
                self._counts["timeouts"] += 1
                self._counts["worker_restarts"] += 1
            logger.warning("grammar compile of %s timed out after %.1fs; worker killed", kind, timeout)
            return GrammarError(f"grammar compilation timed out after {timeout:g}s ({kind} too complex)",
                                code="grammar_too_complex", timed_out=True), 0
        if not reply["ok"]:
            with self._lock:
                self._counts["failed"] += 1
            return GrammarError(reply["error"], code=reply.get("code") or "invalid_value"), 0
        from outlines_core import Index

        blob = reply["index"]
        index = Index.from_binary(blob)
        with self._lock:
            self._counts["compiled"] += 1
        compiled = CompiledGrammar(index, job.key, reply["regex"], self.eos_ids, self._single, self._first,
                                   self.vocab_size)
        return compiled, len(blob)

    def _finish(self, job: _Job, result: tuple[CompiledGrammar | GrammarError, int]) -> None:
        outcome, size = result
        with self._lock:
            self._cache[job.key] = outcome
            self._sizes[job.key] = size
            self._cache.move_to_end(job.key)
            while len(self._cache) > max(1, self.cfg.grammar_cache_size) or (
                    sum(self._sizes.values()) > CACHE_MAX_BYTES and len(self._cache) > 1):
                old, _ = self._cache.popitem(last=False)
                self._sizes.pop(old, None)
            if self._inflight.get(job.key) is job:
                del self._inflight[job.key]
        job.outcome = outcome
        job.event.set()


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


# ------------------------------------------------------------ scheduler seam (runtime/scheduler Protocol)


class GrammarCompileError(ValueError):
    """Raised by the scheduler seam's future for a failed or timed-out compile."""

    def __init__(self, err: GrammarError) -> None:
        super().__init__(err.message)
        self.code = err.code
        self.timed_out = err.timed_out


class SchedulerFuture:
    """`done()`, `result()` (a Grammar, whose `copy()` the scheduler takes; raises GrammarCompileError),
    `cancel()`: the shape runtime/scheduler/scheduler.py's GrammarBackend Protocol polls."""

    def __init__(self, inner: GrammarFuture) -> None:
        self.inner = inner

    def done(self) -> bool:
        return self.inner.done()

    def result(self) -> Grammar:
        out = self.inner.result()
        if out is None:
            raise RuntimeError("grammar compile has not finished")
        if isinstance(out, GrammarError):
            raise GrammarCompileError(out)
        return out

    def cancel(self) -> None:
        self.inner.cancel()


def params_constraint(params) -> tuple[str, str] | None:  # noqa: ANN001 (SamplingParams)
    """(kind, spec) of a SamplingParams' constraint, or None. ebnf maps to kind "ebnf" (unsupported here)."""
    import json

    if params.regex is not None:
        return "regex", params.regex
    if params.json_schema is not None:
        return "json_schema", params.json_schema
    if params.choices is not None:
        return "choices", json.dumps(list(params.choices))
    if params.ebnf is not None:
        return "ebnf", params.ebnf
    return None


def _get_future(self: GrammarBackend, params) -> SchedulerFuture | None:  # noqa: ANN001
    kc = params_constraint(params)
    if kc is None:
        return None
    if kc[0] == "ebnf":
        return SchedulerFuture(GrammarFuture(outcome=GrammarError("ebnf grammars are not supported by the "
                                                                  "outlines grammar backend")))
    return SchedulerFuture(self.submit(*kc))


GrammarBackend.get_future = _get_future  # the scheduler seam: get_future(SamplingParams) -> future | None


def create_grammar_backend(cfg, tok) -> GrammarBackend | None:  # noqa: ANN001 (runtime.config.Config, Tokenizer)
    """What runtime/scheduler/process.py calls in the scheduler process."""
    if cfg.grammar.grammar_backend == "none":
        return None
    return GrammarBackend.from_tokenizer(tok, cfg.grammar)


def validate_params(params, whitespace: str | None = None) -> None:  # noqa: ANN001 (SamplingParams)
    """Server-side check of a request's constraint (400 on GrammarValidationError, a ValueError)."""
    kc = params_constraint(params)
    if kc is None:
        return
    if kc[0] == "ebnf":
        from runtime.constrained.schema import GrammarValidationError

        raise GrammarValidationError("ebnf grammars are not supported by the outlines grammar backend")
    _validate(kc[0], kc[1], whitespace)
