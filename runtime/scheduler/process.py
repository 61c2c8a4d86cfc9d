"""The scheduler process: its entry point, its wiring and its loop.

`run_scheduler_process(spec)` is the spawn target (runtime/launch.py). It builds the scheduler through a
factory (`create_scheduler`: model runner, tokenizer, grammar backend; tests swap in a fake through
RADIXGEN_SCHEDULER_FACTORY), reports ready, then runs `SchedulerLoop`:
receive from the TokenizerManager -> `Scheduler.handle` each message -> `Scheduler.step()` -> push the
step's `BatchTokenOut` to the detokenizer; control replies go straight back to the TokenizerManager.

`--enable-overlap-schedule` (an experiment, off by default; bench/results/mixed_steps.md has the figures):
the forward runs on a worker thread while the loop thread receives, decodes and queues new requests (control
messages and aborts wait until the step ends), so arrivals are ready for the next step's plan.
"""

from __future__ import annotations

import gc
import importlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import zmq

from kernels import fallbacks
from runtime.child import start_child
from runtime.config import Config
from runtime.ipc import Endpoints, Receiver, Sender
from runtime.messages import (
    BatchEmbeddingOut,
    BatchTokenizedEmbeddingReq,
    BatchTokenOut,
    EmbeddingOut,
    FinishAbort,
    FlushCacheOut,
    InternalStateOut,
    ModelInfo,
    ReqTokenOut,
    ShutdownReq,
    ToDetokenizer,
    TokenizedGenerateReq,
    ToScheduler,
    ToTokenizer,
)

if TYPE_CHECKING:
    import torch

    from runtime.constrained.seam import BaseGrammarBackend
    from runtime.scheduler.embedding import EmbeddingScheduler
    from runtime.scheduler.hicache import HiCache
    from runtime.scheduler.scheduler import Scheduler
    from runtime.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_SCHEDULER_FACTORY = "runtime.scheduler.process:create_scheduler"
BatchT = TypeVar("BatchT")


class LoopScheduler(Protocol[BatchT]):
    """What SchedulerLoop drives: the real Scheduler, the embedding scheduler (embedding mode: no overlap
    schedule, so never begin_step/forward/end_step), or a test's fake (tests/server/fake_scheduler.py).
    `BatchT` is the scheduler's own step batch, opaque to the loop."""

    cfg: Config
    grammar_backend: BaseGrammarBackend | None
    last_forward: tuple[bool, float] | None  # (decode only, forward seconds) of the last step; the loop clears it

    def handle(self, msg: ToScheduler) -> FlushCacheOut | InternalStateOut | None:
        """Take one message; a control message's reply goes back to the TokenizerManager."""
        ...

    def has_work(self) -> bool: ...

    def step(self) -> list[ReqTokenOut] | list[EmbeddingOut]:
        """One iteration: plan, forward, process; the outputs of every request that progressed or finished
        (embedding mode: the embeddings of the step's inputs, runtime/scheduler/embedding.py)."""
        ...

    def begin_step(self) -> BatchT | None:
        """`step` split for the overlap schedule: plan (None: nothing to run) ..."""
        ...

    def forward(self, batch: BatchT) -> torch.Tensor | None:
        """... the forward (on the loop's worker thread) ..."""
        ...

    def end_step(self, batch: BatchT | None, logits: torch.Tensor | None) -> list[ReqTokenOut]:
        """... and processing its result."""
        ...


def run_scheduler_process(spec: dict) -> None:
    start_child(spec, "scheduler", _build_scheduler_loop)


def create_scheduler(cfg: Config) -> tuple[Scheduler | EmbeddingScheduler, ModelInfo]:
    """The real scheduler over the model runner (cfg already resolved by the parent); returns it and what
    the parent needs to know. An encoder (--is-embedding) gets the embedding scheduler instead."""
    if cfg.model.is_embedding:
        from runtime.scheduler.embedding import create_embedding_scheduler

        return create_embedding_scheduler(cfg)
    from runtime.executor.model_runner import create_model_runner
    from runtime.scheduler import Scheduler
    from runtime.tokenizer.load import load_tokenizer

    runner = create_model_runner(cfg, progress=False)
    path = cfg.model.tokenizer_path or cfg.model.model_path
    if path is None:
        raise ValueError("the scheduler needs a resolved model path")
    tok = load_tokenizer(path)
    draft = None
    if cfg.speculative.speculative_draft_model_path is not None:  # --speculative-algorithm draft
        from runtime.executor.draft import create_draft_runner

        draft = create_draft_runner(cfg, runner, tok)
    sched = Scheduler(runner, runner.allocator, runner.req_to_token, cfg, runner.eos_token_ids,
                      hicache=_hicache(cfg, runner),
                      decode_fn=tok.decode, grammar_backend=_grammar_backend(cfg, tok),
                      # Forced grammar text is plain text: control-token spellings stay characters.
                      encode_fn=lambda text: tok.encode(text, add_special_tokens=False, allow_special=False),
                      token_bytes_fn=tok.token_bytes, draft_runner=draft)
    return sched, ModelInfo(runner.context_len, runner.vocab_size, runner.pool.num_slots,
                            fallbacks=fallbacks.recorded())


def _hicache(cfg: Config, runner: Any) -> HiCache | None:
    """The hierarchical cache over the runner's KV pool, keyed by everything that makes its bytes reusable."""
    if not cfg.cache.enable_hierarchical_cache:
        return None
    from runtime.scheduler.hicache import create_hicache, model_identity

    pool = runner.pool
    identity = {**model_identity(str(runner.model_path)), "dtype": cfg.model.dtype,
                "quantization": cfg.model.quantization, "kv_dtype": str(pool.k_cache.dtype),
                "page_size": cfg.cache.page_size, "kv_shape": list(pool.k_cache.shape[:1]) + list(pool.k_cache.shape[2:]),
                "layout": "token-major [n, 2, layers, kv_heads, head_dim]"}
    return create_hicache(cfg.cache, pool, identity)


def _grammar_backend(cfg: Config, tok: Tokenizer) -> BaseGrammarBackend | None:
    """The configured grammar backend; one whose package cannot load raises (BackendUnavailable: one line
    naming the package and its install command), so start-up stops instead of serving without constraints."""
    if cfg.grammar.grammar_backend == "none":
        return None
    from runtime.constrained.pool import create_grammar_backend

    return create_grammar_backend(cfg, tok)


def _load_factory(path: str) -> Callable[[Config], tuple[LoopScheduler[Any], ModelInfo]]:
    module, _, func = path.partition(":")
    factory: Callable[[Config], tuple[LoopScheduler[Any], ModelInfo]] = getattr(importlib.import_module(module), func)
    return factory


class SchedulerLoop:
    """receive -> handle -> step -> send, forever (until ShutdownReq)."""

    def __init__(self, scheduler: LoopScheduler[Any], model: ModelInfo, ctx: zmq.Context, ep: Endpoints) -> None:
        self.scheduler, self.model = scheduler, model
        self._recv = Receiver(ctx, ep.scheduler, ToScheduler)
        self._to_detok = Sender(ctx, ep.detokenizer, ToDetokenizer)
        self._to_tm = Sender(ctx, ep.tokenizer, ToTokenizer)
        overlap = scheduler.cfg.scheduler.enable_overlap_schedule and not model.is_embedding
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="forward") if overlap else None
        self._later: list[ToScheduler] = []  # messages received during a forward, handled after it
        self.timer = StepTimer()

    def run(self) -> None:
        s = self.scheduler
        idle_wait = True
        idle = getattr(s, "on_idle", None)  # a scheduler's between-steps hook (swaps in ready decode graphs)
        self.timer.watch_gc()
        while True:
            t0 = time.perf_counter()
            if s.has_work() and not idle_wait:
                msgs = self._recv.drain()
            else:  # idle: block (1 s slices); busy but nothing came out last step: yield briefly
                wait = 0 if self._later else 1000 if not s.has_work() else 1
                first = self._recv.recv(timeout_ms=wait)
                msgs = [] if first is None else [first, *self._recv.drain()]
                if not msgs and not self._later and not s.has_work():
                    if idle is not None:
                        idle()
                    continue
                t0 = time.perf_counter()  # waiting for work is not step time
            msgs, self._later = self._later + msgs, []
            for msg in msgs:
                if isinstance(msg, ShutdownReq):
                    return
                self._handle(msg)
            outs = s.step() if self._pool is None else self._overlapped_step(self._pool)
            if outs:
                self._publish(outs)
            idle_wait = not outs
            fwd, s.last_forward = s.last_forward, None
            if fwd is not None and fwd[0]:
                self.timer.add(time.perf_counter() - t0, fwd[1])

    def _publish(self, outs: list[Any]) -> None:
        """A step's outputs: generated tokens to the detokenizer, embeddings straight to the TokenizerManager."""
        if self.model.is_embedding:
            self._to_tm.send(BatchEmbeddingOut(outs=outs))
        else:
            self._to_detok.send(BatchTokenOut(outs=outs))

    def _overlapped_step(self, pool: ThreadPoolExecutor) -> list[ReqTokenOut]:
        """One step with the forward on the worker thread; meanwhile new requests are received and queued."""
        s = self.scheduler
        batch = s.begin_step()
        if batch is None:
            return s.end_step(None, None)
        fut = pool.submit(s.forward, batch)
        while not fut.done():
            msg = self._recv.recv(timeout_ms=1)
            if isinstance(msg, TokenizedGenerateReq):
                self._handle(msg)  # only appends to the waiting or grammar queue: safe during the forward
            elif msg is not None:
                self._later.append(msg)
        return s.end_step(batch, fut.result())

    def _handle(self, msg: ToScheduler) -> None:
        try:
            reply = self.scheduler.handle(msg)
        except Exception as e:  # a bad request aborts itself only
            if not isinstance(msg, TokenizedGenerateReq | BatchTokenizedEmbeddingReq):
                raise
            why = f"internal error: {type(e).__name__}: {e}"
            if isinstance(msg, BatchTokenizedEmbeddingReq):
                logger.exception("embedding request %s failed", msg.reqs[0].rid if msg.reqs else "")
                self._publish([EmbeddingOut(rid=r.rid, embedding=b"", prompt_tokens=0, error=why) for r in msg.reqs])
                return
            logger.exception("request %s failed", msg.rid)
            self._publish([ReqTokenOut(rid=msg.rid, new_ids=[], finish_reason=FinishAbort(message=why))])
            return
        if isinstance(reply, InternalStateOut):
            reply = InternalStateOut(state={**reply.state, **self._grammar_state(), **self.timer.state()})
        if reply is not None:
            self._to_tm.send(reply)

    def _grammar_state(self) -> dict[str, Any]:
        """Grammar compile counters under SGLang's metric names (none without a grammar backend)."""
        if self.scheduler.grammar_backend is None:
            return {}
        g = self.scheduler.grammar_backend.stats()
        return {"num_grammar_total": g.get("compile_count", 0) + g.get("cache_hits", 0),
                "num_grammar_cache_hit_total": g.get("cache_hits", 0),
                "num_grammar_timeout_total": g.get("timeouts", 0),
                "grammar_compilation_time_seconds_sum": g.get("compile_time_total", 0.0)}


class StepTimer:
    """Wall time of the loop's decode-only iterations (receive + handle + plan + forward + sample + send), and
    the part of it inside runner.forward: what is left is the host time per decode step. Cumulative, so a benchmark diffs two reads of /get_server_info. With the overlap schedule the
    forward runs on a worker thread and its span is still subtracted. Also the process's cyclic-GC pauses
    (count and seconds), which stall every step they fall in."""

    def __init__(self) -> None:
        self.steps, self.step_s, self.forward_s = 0, 0.0, 0.0
        # cyclic-GC pauses of this process (every generation): a full collection stalls the whole loop
        self.gc_count, self.gc_s, self._gc_t0 = 0, 0.0, 0.0

    def watch_gc(self) -> None:
        """Count this process's GC pauses from now on (the loop calls it once, when it starts)."""
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_count += 1
            self.gc_s += time.perf_counter() - self._gc_t0

    def add(self, step_s: float, forward_s: float) -> None:
        self.steps += 1
        self.step_s += step_s
        self.forward_s += forward_s

    def state(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {"decode_steps_timed": self.steps, "decode_step_s_total": self.step_s,
                "decode_forward_s_total": self.forward_s,
                "decode_host_ms_mean": 1e3 * (self.step_s - self.forward_s) / n,
                "gc_collections": self.gc_count, "gc_pause_s_total": self.gc_s,
                "gc_frozen_objects": gc.get_freeze_count()}


def _build_scheduler_loop(cfg: Config, ctx: zmq.Context, spec: dict) -> SchedulerLoop:
    factory = _load_factory(spec.get("scheduler_factory") or DEFAULT_SCHEDULER_FACTORY)
    scheduler, model = factory(cfg)
    return SchedulerLoop(scheduler, model, ctx, Endpoints(**spec["endpoints"]))
