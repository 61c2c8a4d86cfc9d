"""ForwardBatch: the immutable view of one step that the scheduler hands the model runner.

Scheduler (Batch of Reqs) -> ForwardBatch (tensors) -> ModelRunner.forward -> logits [K, vocab] float32
for the positions in `logits_indices` (each request's last new token, plus prompt-logprob positions).
`attn_metadata` is the one place a step's AttnMetadata is built (eager forwards and CUDA-graph replays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.api import AttnMetadata


@dataclass(frozen=True)
class ForwardBatch:
    """B requests, T new tokens. Invariant: seq_lens[b] == prefix_lens[b] + extend_lens[b]; T == sum(extend_lens).

    Rows [0, num_decode) are decode rows (one new token each, tokens [0, num_decode)); rows [num_decode, B)
    are extend rows (prompt chunks, jump-forward extends), so a mixed prefill+decode step is one batch and one
    model forward. num_decode == B is an all-decode step (the shape CUDA graphs and compiled decode replay).
    Request b's new tokens are input_ids[start_b : start_b + extend_lens[b]] at positions
    prefix_lens[b] .. seq_lens[b]-1; their K/V go to out_cache_loc (the scheduler already wrote these slots
    into req_to_token[req_pool_indices[b], prefix_lens[b]:seq_lens[b]]).
    """

    num_decode: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    logits_indices: torch.Tensor  # [K] int64 indices into the T new tokens

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    def attn_metadata(self, req_to_token: torch.Tensor, seq_lens: torch.Tensor, prefix_lens: torch.Tensor,
                      extend_lens: torch.Tensor) -> AttnMetadata:
        """The step's attention metadata. This batch's index tensors must already be on the model's device;
        `seq_lens`, `prefix_lens`, `extend_lens` are the device copies [B] int64 of its host length tuples."""
        return AttnMetadata(
            num_decode=self.num_decode,
            req_to_token=req_to_token,
            req_pool_indices=self.req_pool_indices,
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            out_cache_loc=self.out_cache_loc,
            seq_lens_cpu=self.seq_lens,
            prefix_lens_cpu=self.prefix_lens,
            extend_lens_cpu=self.extend_lens,
        )

    @property
    def is_decode(self) -> bool:
        """Every row is a decode row."""
        return self.num_decode == len(self.seq_lens)

    @staticmethod
    def build(
        input_ids: list[list[int]],
        prefix_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_pool_indices: list[int],
        num_decode: int = 0,
        logits_indices: list[int] | None = None,
    ) -> ForwardBatch:
        """From per-request new token lists (decode rows first). Default logits_indices: the last new token of
        each request."""
        extend = [len(x) for x in input_ids]
        if not 0 <= num_decode <= len(extend) or any(e != 1 for e in extend[:num_decode]):
            raise ValueError(f"num_decode {num_decode}: the first rows must have one new token each ({extend[:8]})")
        flat = [t for ids in input_ids for t in ids]
        pos = [p for plen, e in zip(prefix_lens, extend, strict=True) for p in range(plen, plen + e)]
        if logits_indices is None:
            ends, acc = [], 0
            for e in extend:
                acc += e
                ends.append(acc - 1)
            logits_indices = ends
        return ForwardBatch(
            num_decode=num_decode,
            input_ids=torch.tensor(flat, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            out_cache_loc=out_cache_loc.to(torch.int64),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64),
            seq_lens=tuple(p + e for p, e in zip(prefix_lens, extend, strict=True)),
            prefix_lens=tuple(prefix_lens),
            extend_lens=tuple(extend),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        )
