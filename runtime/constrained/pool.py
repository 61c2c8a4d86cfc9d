"""The compile pool, `GrammarBackend` (the seam's BaseGrammarBackend, seam.py): compile constraints off the
scheduler thread with a timeout and an LRU cache, over one of three engines chosen by `--grammar-backend`
(SGLang's names): llguidance, xgrammar, outlines.

Threads:
    scheduler thread --submit(kind, spec)--> job queue --> N compile threads (main process)
    each thread owns an engine `slot` (outlines: one killable subprocess, see outlines_backend.py; llguidance and
    xgrammar: nothing, they compile in the thread with the GIL released and bound their own work).
    The scheduler stops waiting at `grammar_compile_timeout` whatever the engine (runtime/scheduler).

Cache: key (kind, spec) -> compiled or GrammarError (failures and timeouts are cached too), LRU-bounded by
`grammar_cache_size` entries and CACHE_MAX_BYTES of serialized outlines index. Identical specs submitted while
one compiles share that compile. A compiled entry's `new_state()` is a fresh per-request `Grammar`
(runtime/constrained/seam.py).

Scheduler use (non-blocking):
    fut = backend.get_future(sampling_params)          # None when unconstrained; req parked in the grammar queue
    each step: if fut.done(): fut.result() -> Grammar (take .copy()), or raises GrammarCompileError -> abort
    on abort: fut.cancel()
Fail loud: `require_backend(name)` (validate.py) raises BackendUnavailable when the configured engine cannot be
imported; the pool's constructor calls it, so start-up stops there.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from runtime.config import Config, GrammarConfig
from runtime.constrained.errors import GrammarValidationError
from runtime.constrained.grammar import GrammarError, VocabInfo
from runtime.constrained.seam import BaseGrammarBackend, Grammar, GrammarCompileError
from runtime.constrained.validate import KINDS, params_constraint, require_backend
from runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from runtime.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_MAX_BYTES = 1 << 30  # serialized index bytes kept in the cache
_ENGINES = {"llguidance": "LLGuidanceEngine", "xgrammar": "XGrammarEngine", "outlines": "OutlinesEngine"}


class Compiled(Protocol):
    def new_state(self) -> Grammar: ...


class Engine(Protocol):
    name: str

    def validate(self, kind: str, spec: str) -> None: ...
    def new_slot(self) -> Any: ...
    def close_slot(self, slot: Any) -> None: ...
    def compile(self, slot: Any, kind: str, spec: str) -> tuple[Compiled | GrammarError, int, str]: ...


class GrammarFuture:
    """One request's handle on a compile. `result()` never blocks by default."""

    def __init__(self, job: _Job | None = None, outcome: Compiled | GrammarError | None = None) -> None:
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
        assert out is not None  # a job sets its outcome before its event
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
        self.outcome: Compiled | GrammarError | None = None
        self.waiters: list[GrammarFuture] = []
        self.started = False
        self.skip = False


class GrammarBackend(BaseGrammarBackend):
    """Compiles constraints over one vocabulary with the engine `cfg.grammar_backend` names. Thread-safe submit."""

    def __init__(self, vocab: Sequence[bytes | None] | VocabInfo, eos_ids: frozenset[int] | None = None,
                 cfg: GrammarConfig | None = None, num_workers: int = 2) -> None:
        self.cfg = cfg or GrammarConfig()
        if not isinstance(vocab, VocabInfo):
            vocab = VocabInfo(list(vocab), frozenset(eos_ids or ()), {})
        if not vocab.eos_ids:
            raise ValueError("GrammarBackend needs at least one EOS id")
        self.eos_ids = vocab.eos_ids
        self.vocab_size = vocab.vocab_size
        self.name = self.cfg.grammar_backend
        self.engine: Engine | None = None
        if self.name != "none":
            mod = require_backend(self.name)
            self.engine = getattr(mod, _ENGINES[self.name])(vocab, self.cfg)
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], Compiled | GrammarError] = collections.OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self._inflight: dict[tuple[str, str], _Job] = {}
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._times: collections.deque[float] = collections.deque(maxlen=2048)
        self._counts: collections.Counter[str] = collections.Counter()
        self._compile_time_total = 0.0
        self._closed = False
        self._slots: list[Any] = []
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"grammar-{i}")
                         for i in range(max(1, num_workers))]
        if self.engine is not None:
            for t in self._threads:
                t.start()

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer, cfg: GrammarConfig | None = None, num_workers: int = 2) -> GrammarBackend:
        """From runtime.tokenizer.Tokenizer: byte tokens, special tokens apart, its EOS set and encoder."""
        return cls(vocab_info(tok), cfg=cfg, num_workers=num_workers)

    # ------------------------------------------------------------ public API

    def validate(self, kind: str, spec: str) -> None:
        """Cheap structural check; raises GrammarValidationError (a ValueError)."""
        if self.engine is None:
            raise GrammarValidationError("constrained decoding is disabled (--grammar-backend none)")
        self.engine.validate(kind, spec)

    def submit(self, kind: str, spec: str) -> GrammarFuture:
        key = (kind, spec)
        if self.engine is None:
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

    def get_future(self, params: SamplingParams) -> SchedulerFuture | None:
        """The seam: submit `params`' constraint (kind, spec); None for an unconstrained request."""
        kc = params_constraint(params)
        if kc is None:
            return None
        return SchedulerFuture(self.submit(*kc))

    def compile_blocking(self, kind: str, spec: str, timeout: float | None = None) -> Grammar | GrammarError:
        """submit() and wait (tests, benches, offline tools; never the scheduler thread)."""
        fut = self.submit(kind, spec)
        limit = timeout if timeout is not None else self.cfg.grammar_compile_timeout * 4 + 120
        res = fut.result(timeout=limit)
        return res if res is not None else GrammarError("compile did not finish in time", timed_out=True)

    def stats(self) -> dict:
        with self._lock:
            times = sorted(self._times)
            c = self._counts
            return {
                "backend": self.name,
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
        if self.engine is not None:
            for s in self._slots:
                self.engine.close_slot(s)

    def __enter__(self) -> GrammarBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ compile threads

    def _run(self) -> None:
        assert self.engine is not None
        slot = self.engine.new_slot()
        with self._lock:
            self._slots.append(slot)
        while True:
            job = self._queue.get()
            if job is None or self._closed:
                self.engine.close_slot(slot)
                return
            with job.lock:
                if job.skip:
                    with self._lock:
                        if self._inflight.get(job.key) is job:
                            del self._inflight[job.key]
                    continue
                job.started = True
            t0 = time.perf_counter()
            try:
                outcome, size, what = self.engine.compile(slot, *job.key)
            except Exception as e:  # noqa: BLE001 - an engine bug fails this compile, not the thread
                logger.exception("grammar compile of %s raised", job.key[0])
                outcome, size, what = GrammarError(f"grammar compile failed: {type(e).__name__}: {e}"), 0, "failed"
            wall = time.perf_counter() - t0
            with self._lock:
                self._times.append(wall)
                self._compile_time_total += wall
                if what == "crashed":
                    self._counts["failed"] += 1
                    self._counts["worker_restarts"] += 1
                elif what == "timeouts":
                    self._counts["timeouts"] += 1
                    self._counts["worker_restarts"] += 1
                else:
                    self._counts[what] += 1
            if what == "timeouts":
                logger.warning("grammar compile of %s timed out; worker killed", job.key[0])
            self._finish(job, outcome, size)

    def _finish(self, job: _Job, outcome: Compiled | GrammarError, size: int) -> None:
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


def vocab_info(tok: Tokenizer) -> VocabInfo:
    """The vocabulary of a runtime Tokenizer: byte tokens; special tokens (and EOS) apart, with their text."""
    special = frozenset(tok.special_ids) | frozenset(tok.eos_token_ids)
    tokens = [None if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]
    return VocabInfo(tokens, frozenset(tok.eos_token_ids), {i: tok.token_bytes(i) for i in special},
                     tok.bos_token_id, lambda s: tok.encode(s, add_special_tokens=False, allow_special=False))


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


# ------------------------------------------------------------ the seam's future


class SchedulerFuture:
    """The seam's CompileFuture (seam.py) over a GrammarFuture: `result()` raises GrammarCompileError instead of
    returning a GrammarError."""

    def __init__(self, inner: GrammarFuture) -> None:
        self.inner = inner

    def done(self) -> bool:
        return self.inner.done()

    def result(self) -> Grammar:
        out = self.inner.result()
        if out is None:
            raise RuntimeError("grammar compile has not finished")
        if isinstance(out, GrammarError):
            raise GrammarCompileError(out.message, out.code, out.timed_out)
        return out

    def cancel(self) -> None:
        self.inner.cancel()


def create_grammar_backend(cfg: Config, tok: Tokenizer) -> GrammarBackend | None:
    """What runtime/scheduler/process.py calls in the scheduler process; raises BackendUnavailable (start-up
    stops)."""
    if cfg.grammar.grammar_backend == "none":
        return None
    return GrammarBackend.from_tokenizer(tok, cfg.grammar)


