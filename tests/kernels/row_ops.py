"""Test helper: one SmolLM2 forward with the runner's row ops and one with others swapped in.

The eager forward takes its RMSNorm/rope/SiLU-mul from `runner.model.ew` (runtime.models.llama.Elementwise);
swapping it isolates those kernels while attention, weights and the batch stay the same.
"""

from __future__ import annotations

import torch

IDS = [[1, 504, 3458, 314, 260, 1345, 28], [1, 2022, 4462]]  # two prompts, 10 slots


def logits_with_row_ops(runner, ew, ids: list[list[int]] = IDS) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the runner's own row ops, logits with `ew`) for one prefill of `ids`; slots freed after."""
    from runtime.executor.forward_batch import ForwardBatch

    lens = [len(x) for x in ids]
    slots = runner.allocator.alloc(sum(lens))
    rows = [runner.req_to_token.alloc_row() for _ in ids]
    try:
        start = 0
        for row, n in zip(rows, lens, strict=True):
            runner.req_to_token.write(row, 0, slots[start : start + n])
            start += n
        fb = ForwardBatch.build(ids, [0] * len(ids), slots, rows)
        own = runner.forward(fb).clone()
        model, kept = runner.model, runner.model.ew
        model.ew = ew
        try:
            swapped = runner.forward(fb).clone()
        finally:
            model.ew = kept
        return own, swapped
    finally:
        for row in rows:
            runner.req_to_token.free_row(row)
        runner.allocator.free(slots)
