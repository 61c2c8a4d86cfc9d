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


def step_meta(pb, prefix: list[int], extend: list[int], is_decode: bool) -> AttnMetadata:
    """Metadata for one step over pb's table rows: request b adds extend[b] tokens after prefix[b]."""
    dev = pb.k_cache.device
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    rows = pb.req_pool_indices.tolist()
    loc = torch.cat([pb.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq, strict=True)]).long()

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return AttnMetadata(
        num_decode=len(extend) if is_decode else 0, req_to_token=pb.req_to_token, req_pool_indices=pb.req_pool_indices,
        seq_lens=t(seq), prefix_lens=t(prefix), extend_lens=t(extend), out_cache_loc=loc,
        seq_lens_cpu=tuple(seq), prefix_lens_cpu=tuple(prefix), extend_lens_cpu=tuple(extend),
    )


def check_backend_matches_torch(
    name: str, device: str, *, heads: tuple[int, int, int], chunks: tuple[list[int], list[int]], decodes: int,
    page_size: int, dtype: torch.dtype = torch.float32, tol: float = 1e-4, num_layers: int = 2,
) -> None:
    """Run backend `name` and the torch backend side by side over: a prefill chunk (prefix 0), an extend
    over that prefix, then `decodes` decode steps. heads = (Hq, Hkv, D). Outputs must match within tol and
    both pools must end equal (storing K/V is an exact copy)."""
    from kernels import create_attn_backend

    hq, hkv, d = heads
    chunk1, chunk2 = chunks
    b = len(chunk1)
    final = [x + y + decodes for x, y in zip(chunk1, chunk2, strict=True)]
    pb = make_paged_batch(
        [0] * b, final, hkv, d, page_size=page_size, num_layers=num_layers, device=device, dtype=dtype, seed=11
    )
    k_o, v_o = pb.k_cache.clone(), pb.v_cache.clone()
    want_be = create_attn_backend("torch", pb.k_cache, pb.v_cache, d**-0.5)
    got_be = create_attn_backend(name, k_o, v_o, d**-0.5)

    steps = [step_meta(pb, [0] * b, chunk1, False), step_meta(pb, chunk1, chunk2, False)]
    base = [x + y for x, y in zip(chunk1, chunk2, strict=True)]
    steps += [step_meta(pb, [n + i for n in base], [1] * b, True) for i in range(decodes)]
    g = torch.Generator().manual_seed(0)
    for meta in steps:
        t = sum(meta.extend_lens_cpu)
        want_be.init_forward(meta)
        got_be.init_forward(meta)
        call = "decode" if meta.is_decode else "extend"
        for layer in range(num_layers):
            q, k, v = (torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv))
            want = getattr(want_be, call)(q, k, v, layer)
            got = getattr(got_be, call)(q, k, v, layer)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(k_o, pb.k_cache) and torch.equal(v_o, pb.v_cache)
