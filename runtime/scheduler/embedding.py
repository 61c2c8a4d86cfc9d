"""The embedding scheduler: prefill-only steps over an encoder (embedding mode, `--is-embedding`).

Same seam as the generation scheduler for the process loop (runtime/scheduler/process.py): `handle(msg)` for
(Batch)TokenizedEmbeddingReq / AbortReq / FlushCacheReq / GetInternalStateReq, `step()` -> the step's outputs,
`has_work()`. A step takes waiting inputs first come, first served while their tokens fit the step's budget
(`--max-prefill-tokens`, and at most `--max-running-requests` inputs; one input always fits, its length was
checked against the context at submission), embeds them in one forward and answers every one of them:
an input is never split over steps and holds nothing (no KV, no cache) once its step ends. Outputs go
straight to the TokenizerManager as `BatchEmbeddingOut` (there is no text to detokenize).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Protocol

import numpy as np
import torch

from kernels import fallbacks
from runtime.config import Config
from runtime.messages import (
    AbortReq,
    BatchTokenizedEmbeddingReq,
    EmbeddingOut,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateOut,
    ModelInfo,
    TokenizedEmbeddingReq,
)

log = logging.getLogger(__name__)


class Encoder(Protocol):
    """What the embedding scheduler needs of its runner (runtime/executor/embedding_runner.py)."""

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """float32 [len(inputs), dim] on the host."""
        ...


class EmbeddingScheduler:
    def __init__(self, runner: Encoder, cfg: Config) -> None:
        self.runner, self.cfg = runner, cfg
        self.waiting: collections.deque[TokenizedEmbeddingReq] = collections.deque()
        self.max_tokens = cfg.scheduler.max_prefill_tokens
        self.max_inputs = cfg.scheduler.max_running_requests
        self.last_forward: tuple[bool, float] | None = None  # the loop's decode-step timer: never a decode step
        self.grammar_backend = None  # nothing is decoded, so nothing is constrained
        self.stats: collections.Counter[str] = collections.Counter()  # integer counters
        self.forward_s = 0.0  # seconds in the encoder's forward

    def handle(self, msg: Any) -> FlushCacheOut | InternalStateOut | None:
        if isinstance(msg, BatchTokenizedEmbeddingReq):
            self.waiting.extend(msg.reqs)
        elif isinstance(msg, TokenizedEmbeddingReq):
            self.waiting.append(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.abort_all)
        elif isinstance(msg, FlushCacheReq):
            return FlushCacheOut(success=True, message="embedding mode keeps no cache")
        elif isinstance(msg, GetInternalStateReq):
            return InternalStateOut(state=self.internal_state())
        else:
            raise ValueError(f"{type(msg).__name__} cannot run on an embedding model")
        return None

    def abort(self, rid: str | None, abort_all: bool = False) -> None:
        """Drop waiting inputs `rid` / `rid_i` (or all): nothing of theirs is running between steps."""
        def hit(r: TokenizedEmbeddingReq) -> bool:
            return abort_all or (rid is not None and (r.rid == rid or r.rid.startswith(rid + "_")))

        kept = [r for r in self.waiting if not hit(r)]
        self.stats["aborted_reqs"] += len(self.waiting) - len(kept)
        self.waiting = collections.deque(kept)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def _take(self) -> list[TokenizedEmbeddingReq]:
        batch: list[TokenizedEmbeddingReq] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_inputs:
            n = len(self.waiting[0].input_ids)
            if batch and tokens + n > self.max_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    def step(self) -> list[EmbeddingOut]:
        batch = self._take()
        if not batch:
            return []
        t = time.perf_counter()
        try:
            emb = self.runner.embed([r.input_ids for r in batch]).numpy().astype(np.float32, copy=False)
        except Exception as e:  # a failed forward fails its step's inputs only
            log.exception("embedding step of %d inputs failed", len(batch))
            why = f"internal error: {type(e).__name__}: {e}"
            return [EmbeddingOut(rid=r.rid, embedding=b"", prompt_tokens=len(r.input_ids), error=why) for r in batch]
        self.forward_s += time.perf_counter() - t
        self.stats["forward_steps"] += 1
        self.stats["prefill_tokens"] += sum(len(r.input_ids) for r in batch)
        self.stats["embedded_inputs"] += len(batch)
        return [EmbeddingOut(rid=r.rid, embedding=emb[i].tobytes(), prompt_tokens=len(r.input_ids))
                for i, r in enumerate(batch)]

    def internal_state(self) -> dict[str, Any]:
        s = self.stats
        return {"is_embedding": True, "num_running_reqs": 0, "num_waiting_reqs": len(self.waiting),
                "num_grammar_queue_reqs": 0,
                "num_waiting_tokens": sum(len(r.input_ids) for r in self.waiting),
                "max_total_num_tokens": self.max_tokens, "kv_free_slots": self.max_tokens, "kv_evictable_slots": 0,
                "kv_locked_slots": 0, "cache_hit_rate": 0.0, "radix_cache": False,
                "forward_steps": s["forward_steps"], "prefill_tokens": s["prefill_tokens"], "decode_tokens": 0,
                "embedded_inputs": s["embedded_inputs"], "embedding_forward_s_total": self.forward_s,
                "aborted_reqs": s["aborted_reqs"]}


def create_embedding_scheduler(cfg: Config) -> tuple[EmbeddingScheduler, ModelInfo]:
    """The embedding scheduler over the encoder runner (cfg already resolved by the parent)."""
    from runtime.executor.embedding_runner import EmbeddingRunner

    runner = EmbeddingRunner(cfg)
    info = ModelInfo(runner.context_len, runner.vocab_size, cfg.scheduler.max_prefill_tokens, is_embedding=True,
                     embedding_dim=runner.dim, matryoshka_dims=runner.pooling.matryoshka_dims,
                     fallbacks=fallbacks.recorded())
    return EmbeddingScheduler(runner, cfg), info
