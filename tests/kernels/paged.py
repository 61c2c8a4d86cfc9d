"""Test helpers: a random ragged batch laid out in a paged pool (page size 1 or P, pages scattered)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.api import AttnMetadata


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [L, S, Hkv, D]
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # [R, C] int32
    req_pool_indices: torch.Tensor  # [B] int64
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True))

    def new_slots(self) -> torch.Tensor:
        """[T] slots of this step's new tokens (req_to_token at positions prefix..seq-1), int64."""
        rows = self.req_pool_indices.tolist()
        parts = [self.req_to_token[r, p:s] for r, p, s in zip(rows, self.prefix_lens, self.seq_lens, strict=True)]
        return torch.cat(parts).long()

    def meta(self, is_decode: bool) -> AttnMetadata:
        dev = self.k_cache.device

        def t(x: tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        return AttnMetadata(
            is_decode=is_decode, req_to_token=self.req_to_token, req_pool_indices=self.req_pool_indices,
            seq_lens=t(self.seq_lens), prefix_lens=t(self.prefix_lens), extend_lens=t(self.extend_lens),
            out_cache_loc=self.new_slots(), seq_lens_cpu=self.seq_lens,
            prefix_lens_cpu=self.prefix_lens, extend_lens_cpu=self.extend_lens,
        )


def make_paged_batch(
    prefix_lens: list[int], extend_lens: list[int], num_kv_heads: int, head_dim: int, *,
    page_size: int = 1, num_layers: int = 1, device: str = "cpu", dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V pool; each request gets whole pages in a shuffled order, rows of req_to_token shuffled too."""
    g = torch.Generator().manual_seed(seed)
    seqs = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_per_req = [-(-s // page_size) for s in seqs]
    num_pages = sum(pages_per_req) + 3  # a few unused pages
    num_slots = num_pages * page_size
    page_order = torch.randperm(num_pages, generator=g)
    max_ctx = max(pages_per_req) * page_size + 5
    rows = torch.randperm(len(seqs) + 2, generator=g)[: len(seqs)]
    r2t = torch.zeros((len(seqs) + 2, max_ctx), dtype=torch.int32)
    used = 0
    for b, (s, n) in enumerate(zip(seqs, pages_per_req, strict=True)):
        pages = page_order[used : used + n]
        used += n
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()[:s]
        r2t[rows[b], :s] = slots.int()
    shape = (num_layers, num_slots, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    return PagedBatch(
        k_cache=k.to(device), v_cache=v.to(device), req_to_token=r2t.to(device),
        req_pool_indices=rows.to(torch.int64).to(device),
        prefix_lens=tuple(prefix_lens), extend_lens=tuple(extend_lens),
    )


def qo_start(extend_lens: tuple[int, ...], device: str) -> torch.Tensor:
    e = torch.tensor(extend_lens, dtype=torch.int64, device=device)
    return torch.cumsum(e, 0) - e
