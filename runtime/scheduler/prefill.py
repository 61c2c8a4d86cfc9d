"""Prefill admission: which waiting requests join this step's extend rows, and how many tokens each computes.

Budgets for one step (SGLang's PrefillAdder; vLLM V1's one token budget):
- `rem_total`: free + evictable slots, minus the room reserved for running requests' future tokens
  (`min(remaining_new_tokens, CLIP) * new_token_ratio` each); a new request costs its extend tokens plus
  its own reservation. The first request of an otherwise idle scheduler is admitted whenever its prompt fits.
  (With a sliding-window pool `KVManager.room` counts the full pool only; each step's chunk is still cut to
  `KVManager.available`, which also counts the window pool: runtime/scheduler/swa_cache.py.)
- `rem_input`: `max_prefill_tokens` new tokens per step (a lone request may exceed it when chunking is off).
- `rem_chunk`: `chunked_prefill_size`; a longer prompt is cut to what remains and becomes the one in-flight
  chunked request, continued first in the next steps.
In a mixed step the running requests' decode tokens come out of `rem_input` and `rem_chunk` first; prefill
keeps at least `1 / PREFILL_FLOOR_DIV` of each, so a full decode batch cannot starve the waiting queue.

Same-step prefix sharing: each planned extend enters the radix tree at once (`KVManager.cache_planned`), its
node locked by its request, so a later request of the same step that shares the prefix matches it and
extends from those slots: the shared part is computed once. This is exact because the attention backend
stores every new K/V of a layer before any row attends (kernels/api.py), and the model runs all rows of a
step in one forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from runtime.config import SchedulerConfig
from runtime.scheduler.cache import KVManager
from runtime.scheduler.core import Req

CLIP_MAX_NEW_TOKENS = 4096
PREFILL_FLOOR_DIV = 8  # prefill keeps at least budget // 8 tokens of a step, however many requests decode


class PrefillPlan(NamedTuple):
    """`reqs`, `slots`, `offsets`: the step's prefill rows, their new slots and logit offsets (empty: nothing
    to prefill); `admitted`: requests taken off the waiting queue; `chunked`: the request whose prompt is still
    incomplete after this step (or None); `rejected`: requests that can never fit, with the reason."""

    reqs: list[Req]
    slots: list[torch.Tensor]
    offsets: list[list[int]]
    admitted: list[Req]
    chunked: Req | None
    rejected: list[tuple[Req, str]]


def reservation(req: Req, ratio: float) -> int:
    """Slots kept back for `req`'s future output tokens."""
    return math.ceil(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * ratio)


def logit_offsets(req: Req, n: int) -> list[int]:
    """Offsets (within the n new tokens) whose logits are needed: prompt-logprob positions and the last."""
    offs = {n - 1}
    if req.wants_input_logprobs:
        # logits at position j score token j + 1; prompt tokens from max(start, 1) are scored.
        lo = max(req.logprobs.start_len - 1, 0, req.cached_len)
        hi = min(req.prompt_len - 1, req.cached_len + n)  # exclusive
        offs.update(j - req.cached_len for j in range(lo, hi))
    return sorted(offs)


def _after_decode(budget: int, decode_tokens: int) -> int:
    return max(budget - decode_tokens, budget // PREFILL_FLOOR_DIV, 1)


class PrefillAdder:
    """Plans the extend rows of one step. `running`: requests decoding this step (their slots are already
    allocated); `decode_tokens`: their new tokens, charged to this step's budgets (0 in a prefill-only step)."""

    def __init__(self, kv: KVManager, cfg: SchedulerConfig, running: list[Req], ratio: float,
                 decode_tokens: int = 0) -> None:
        self.kv = kv
        self.ratio = ratio
        self.idle = not running
        self.max_new_reqs = cfg.max_running_requests - len(running)
        self.reserved = sum(reservation(r, ratio) for r in running)
        self.rem_input = _after_decode(cfg.max_prefill_tokens, decode_tokens)
        chunk = cfg.chunked_prefill_size
        self.rem_chunk = _after_decode(min(chunk, cfg.max_prefill_tokens), decode_tokens) if chunk > 0 else None
        self.reqs: list[Req] = []
        self.slots: list[torch.Tensor] = []
        self.offsets: list[list[int]] = []

    def plan(self, chunked: Req | None, ordered: list[Req]) -> PrefillPlan:
        admitted: list[Req] = []
        rejected: list[tuple[Req, str]] = []
        still_chunked = None
        if chunked is not None:
            n = self._chunk_len(chunked.fill_len - chunked.cached_len, self.kv.available())
            if n <= 0 or not self._add(chunked, n):
                return self._plan([], chunked, [])
            self.reserved += reservation(chunked, self.ratio)
            if chunked.seq_len < chunked.fill_len:
                return self._plan([], chunked, [])
        for req in ordered:
            if len(self.reqs) >= self.max_new_reqs or self.kv.table.available() == 0:
                break
            if self.rem_chunk is not None and self.rem_chunk <= 0 or self.rem_input <= 0:
                break
            need = req.fill_len + (1 if req.remaining_new_tokens else 0)
            if need > self.kv.total:
                rejected.append((req, f"request needs {need} KV slots but the pool has {self.kv.total}"))
                continue
            extend = req.fill_len - self.kv.peek_match(req)
            if extend > self.rem_input and self.reqs and self.rem_chunk is None:
                break
            if not self.kv.admit(req):
                break
            # Budget after locking the match (a locked prefix is no longer evictable); the real match can
            # also be shorter than the peek if this step evicted part of it.
            extend = req.fill_len - req.cached_len
            own = reservation(req, self.ratio)
            alone = self.idle and not self.reqs
            fits = extend + own <= self.rem_total() or (alone and extend <= self.kv.room())
            n = self._chunk_len(extend, self.kv.available()) if fits else 0
            if n <= 0 or not self._add(req, n):
                self.kv.release(req)
                break
            self.reserved += own
            admitted.append(req)
            if req.seq_len < req.fill_len:
                still_chunked = req
                break
        return self._plan(admitted, still_chunked, rejected)

    def rem_total(self) -> int:
        """Slots new requests may still take: free + evictable minus what is reserved."""
        return self.kv.room() - self.reserved

    def _chunk_len(self, extend: int, avail: int) -> int:
        """Tokens to compute now: the whole extend, or what the chunk budget and the pool allow."""
        n = min(extend, avail)
        if self.rem_chunk is not None and n > self.rem_chunk:
            n = self.rem_chunk
        if n < extend:
            n -= n % self.kv.page_size
        return n

    def _add(self, req: Req, n: int) -> bool:
        slots = self.kv.extend(req, n)
        if slots is None:
            return False
        self.reqs.append(req)
        self.slots.append(slots)
        self.offsets.append(logit_offsets(req, n))
        self.rem_input -= n
        if self.rem_chunk is not None:
            self.rem_chunk -= n
        self.kv.cache_planned(req)
        return True

    def _plan(self, admitted: list[Req], chunked: Req | None, rejected: list[tuple[Req, str]]) -> PrefillPlan:
        return PrefillPlan(self.reqs, self.slots, self.offsets, admitted, chunked, rejected)
