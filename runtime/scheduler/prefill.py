"""Prefill admission: which waiting requests join the next prefill batch, and how many tokens each computes.

Budgets for one batch (SGLang's PrefillAdder, reference/sglang.md 2.5):
- `rem_total`: free + evictable slots, minus the room reserved for running requests' future tokens
  (`min(remaining_new_tokens, CLIP) * new_token_ratio` each); a new request costs its extend tokens plus
  its own reservation. The first request of an otherwise idle scheduler is admitted whenever its prompt fits.
- `rem_input`: `max_prefill_tokens` new tokens per batch (a lone request may exceed it when chunking is off).
- `rem_chunk`: `chunked_prefill_size`; a longer prompt is cut to what remains and becomes the one in-flight
  chunked request, continued first in the next steps. Its computed part enters the tree between chunks.
In-batch prefix sharing: a request that shares a longer prefix with a request already in this batch than
with the tree is deferred one step, so it hits the tree once that prefix is computed (this is how `n > 1`
copies of one prompt share one prefill).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from radix_cache import RadixCache
from runtime.config import SchedulerConfig
from runtime.scheduler.cache import KVManager
from runtime.scheduler.core import Batch, Req

CLIP_MAX_NEW_TOKENS = 4096
IN_BATCH_PREFIX_MIN = 32  # defer when the batch would share at least this many more tokens than the tree


class PrefillPlan(NamedTuple):
    """`batch`: the prefill batch (None: nothing to prefill); `admitted`: requests taken off the waiting
    queue; `chunked`: the request whose prompt is still incomplete after this batch (or None);
    `rejected`: requests that can never fit, with the reason."""

    batch: Batch | None
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
        lo = max(req.logprob_start_len - 1, 0, req.cached_len)
        hi = min(req.prompt_len - 1, req.cached_len + n)  # exclusive
        offs.update(j - req.cached_len for j in range(lo, hi))
    return sorted(offs)


class PrefillAdder:
    def __init__(self, kv: KVManager, cfg: SchedulerConfig, running: list[Req], ratio: float) -> None:
        self.kv = kv
        self.ratio = ratio
        self.idle = not running
        self.max_new_reqs = cfg.max_running_requests - len(running)
        self.reserved = sum(reservation(r, ratio) for r in running)
        self.rem_input = cfg.max_prefill_tokens
        chunk = cfg.chunked_prefill_size
        self.rem_chunk = min(chunk, cfg.max_prefill_tokens) if chunk > 0 else None
        self.reqs: list[Req] = []
        self.slots: list[torch.Tensor] = []
        self.offsets: list[list[int]] = []
        self.shadow = RadixCache(page_size=kv.page_size)  # token ids of this batch, for in-batch sharing

    def plan(self, chunked: Req | None, ordered: list[Req]) -> PrefillPlan:
        admitted: list[Req] = []
        rejected: list[tuple[Req, str]] = []
        still_chunked = None
        if chunked is not None:
            n = self._chunk_len(len(chunked.fill_ids) - chunked.cached_len, self.kv.available())
            if n <= 0 or not self._add(chunked, n):
                return PrefillPlan(None, [], chunked, [])
            self.reserved += reservation(chunked, self.ratio)
            if chunked.seq_len < len(chunked.fill_ids):
                return PrefillPlan(self._batch(), [], chunked, [])
        for req in ordered:
            if len(self.reqs) >= self.max_new_reqs or self.kv.table.available() == 0:
                break
            need = len(req.fill_ids) + (1 if req.remaining_new_tokens else 0)
            if need > self.kv.total:
                rejected.append((req, f"request needs {need} KV slots but the pool has {self.kv.total}"))
                continue
            cached = self.kv.peek_match(req)
            extend = len(req.fill_ids) - cached
            if self._defer_for_sharing(req, cached, extend):
                continue
            if extend > self.rem_input and self.reqs and self.rem_chunk is None:
                break
            if not self.kv.admit(req):
                break
            # Budget after locking the match (a locked prefix is no longer evictable); the real match can
            # also be shorter than the peek if this batch evicted part of it.
            extend = len(req.fill_ids) - req.cached_len
            own = reservation(req, self.ratio)
            alone = self.idle and not self.reqs
            fits = extend + own <= self.rem_total() or (alone and extend <= self.kv.available())
            n = self._chunk_len(extend, self.kv.available()) if fits else 0
            if n <= 0 or not self._add(req, n):
                self.kv.release(req)
                break
            self.reserved += own
            admitted.append(req)
            if req.seq_len < len(req.fill_ids):
                still_chunked = req
                break
        batch = self._batch() if self.reqs else None
        return PrefillPlan(batch, admitted, still_chunked, rejected)

    def rem_total(self) -> int:
        """Slots new requests may still take: free + evictable minus what is reserved."""
        return self.kv.available() - self.reserved

    def _chunk_len(self, extend: int, avail: int) -> int:
        """Tokens to compute now: the whole extend, or what the chunk budget and the pool allow."""
        n = min(extend, avail)
        if self.rem_chunk is not None and n > self.rem_chunk:
            n = self.rem_chunk
        if n < extend:
            n -= n % self.kv.page_size
        return n

    def _defer_for_sharing(self, req: Req, cached: int, extend: int) -> bool:
        if not self.reqs or self.kv.tree is None:
            return False
        ids = req.fill_ids[: req.match_cap()]
        shared = self.shadow.match_prefix(ids, record=False).length if ids else 0
        gain = shared - cached
        return gain > 0 and (gain >= IN_BATCH_PREFIX_MIN or gain >= extend - 1)

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
        ids = req.fill_ids[: req.seq_len]
        self.shadow.insert(ids, torch.zeros(len(ids), dtype=torch.int64))
        return True

    def _batch(self) -> Batch:
        return Batch(list(self.reqs), False, torch.cat(self.slots), list(self.offsets))
