"""A minimal offline driver: prefill a list of prompts, then greedy-decode them together.

No scheduler, no cache: every request gets a fresh table row and fresh slots. Used by model tests and
`bench/one_batch.py`; serving goes through runtime.scheduler instead.
"""

from __future__ import annotations

from typing import cast

import torch

from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.model_runner import ModelRunner


class OfflineBatch:
    """Rows and slots of a fixed set of requests, freed by `release()`."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        rows = [runner.req_to_token.alloc_row() for _ in prompts]
        if None in rows:
            raise RuntimeError("not enough request rows")
        self.rows = cast("list[int]", rows)  # no None left: checked above
        self.lens = [0] * len(prompts)
        self.owned: list[torch.Tensor] = []

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.runner.allocator.alloc(n)
        if slots is None:
            raise RuntimeError("KV pool exhausted")
        self.owned.append(slots)
        return slots

    def extend(self, new_ids: list[list[int]], is_decode: bool = False) -> torch.Tensor:
        """Append new tokens to each request (prefill, extend or decode); logits of each last token [B, V]."""
        slots = self._alloc(sum(len(x) for x in new_ids))
        start = 0
        for b, ids in enumerate(new_ids):
            self.runner.req_to_token.write(self.rows[b], self.lens[b], slots[start : start + len(ids)])
            start += len(ids)
        fb = ForwardBatch.build(new_ids, list(self.lens), slots, self.rows, num_decode=len(new_ids) if is_decode else 0)
        logits = self.runner.forward(fb)
        self.lens = [n + len(ids) for n, ids in zip(self.lens, new_ids, strict=True)]
        return logits

    def release(self) -> None:
        for slots in self.owned:
            self.runner.allocator.free(slots)
        for row in self.rows:
            self.runner.req_to_token.free_row(row)
        self.owned, self.rows = [], []


def greedy_generate(
    runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, eos_ids: frozenset[int] = frozenset()
) -> list[list[int]]:
    """Greedy continuation of each prompt (batched prefill, then batched decode), stopping at EOS."""
    batch = OfflineBatch(runner, prompts)
    try:
        logits = batch.extend(prompts)
        outs: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1).tolist()
            for b, t in enumerate(nxt):
                if not done[b]:
                    outs[b].append(t)
                    done[b] = t in eos_ids
            if all(done) or step == max_new_tokens - 1:  # no forward for a token nobody will read
                break
            logits = batch.extend([[t] for t in nxt], is_decode=True)
        return outs
    finally:
        batch.release()
