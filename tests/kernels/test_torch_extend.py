"""The fast CPU extend attention (kernels/torch_extend.py) equals the reference (kernels/ref.py).

Ragged batches in a paged pool (pages scattered, page size 1 or 16), GQA ratios 1, 3, 8, with and without
cached prefixes, and with prefixes shared by every request (the RAG shape: same slots, different questions)
or shared only in part.
"""

from __future__ import annotations

import pytest
import torch

from kernels import ref, torch_extend
from kernels.torch_backend import TorchAttnBackend
from tests.kernels.paged import PagedBatch, make_paged_batch, step_meta

HKV, D = 2, 16
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

CASES = {
    # name: (prefix_lens, extend_lens, leading slots request 0 shares with every other request)
    "prefill": ([0, 0, 0, 0], [1, 17, 40, 5], 0),
    "empty_extend": ([0, 12, 0], [9, 0, 4], 0),  # a request with no new tokens this step
    "prefix": ([3, 0, 29, 64], [9, 12, 1, 33], 0),
    "shared": ([48, 48, 48, 48, 48], [7, 1, 20, 13, 2], 48),
    "shared_then_own": ([40, 57, 40, 70], [5, 11, 1, 8], 40),
    "shared_part": ([50, 60, 50], [6, 3, 9], 33),
    "single": ([37], [21], 0),
}


def _batch(case: str, page_size: int, dtype: torch.dtype, seed: int) -> PagedBatch:
    prefix, extend, shared = CASES[case]
    pb = make_paged_batch(prefix, extend, HKV, D, page_size=page_size, dtype=dtype, seed=seed)
    rows = pb.req_pool_indices.tolist()
    for r in rows[1:]:  # alias the leading slots, as the radix cache does for a common prefix
        pb.req_to_token[r, :shared] = pb.req_to_token[rows[0], :shared]
    return pb


def _reference(pb: PagedBatch, q: torch.Tensor) -> torch.Tensor:
    return ref.extend_attention(
        q,
        pb.k_cache[0],
        pb.v_cache[0],
        pb.req_to_token,
        pb.req_pool_indices,
        pb.prefix_lens,
        pb.extend_lens,
        D**-0.5,
    )


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_extend_matches_reference(case, group, page_size, dtype):
    pb = _batch(case, page_size, dtype, seed=group * 10 + page_size)
    g = torch.Generator().manual_seed(group)
    q = torch.randn(sum(pb.extend_lens), HKV * group, D, generator=g).to(dtype)
    got = torch_extend.extend_attention(
        q,
        pb.k_cache[0],
        pb.v_cache[0],
        pb.req_to_token,
        pb.req_pool_indices,
        pb.prefix_lens,
        pb.extend_lens,
        D**-0.5,
    )
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), _reference(pb, q).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("case", ["prefill", "shared_then_own"])
def test_backend_extend_stores_then_matches_reference(case):
    """Through TorchAttnBackend.extend: new K/V land in the pool, and the output is the reference's."""
    pb = _batch(case, 16, torch.float32, seed=3)
    rows = pb.req_pool_indices.tolist()
    seqs = pb.seq_lens
    meta = step_meta(pb, list(pb.prefix_lens), list(pb.extend_lens), False)
    g = torch.Generator().manual_seed(5)
    t = sum(pb.extend_lens)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HKV * 3, HKV, HKV))
    backend = TorchAttnBackend(pb.k_cache.clone(), pb.v_cache.clone(), D**-0.5)
    backend.init_forward(meta)
    got = backend.extend(q, k, v, 0)
    loc = torch.cat([pb.req_to_token[r, p:s] for r, p, s in zip(rows, pb.prefix_lens, seqs, strict=True)])
    assert torch.equal(backend.k_cache[0, loc.long()], k) and torch.equal(backend.v_cache[0, loc.long()], v)
    want = ref.extend_attention(
        q,
        backend.k_cache[0],
        backend.v_cache[0],
        pb.req_to_token,
        pb.req_pool_indices,
        pb.prefix_lens,
        pb.extend_lens,
        D**-0.5,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_shared_prefix_len():
    pb = _batch("shared_part", 1, torch.float32, seed=0)
    rows = pb.req_pool_indices.tolist()
    assert torch_extend.shared_prefix_len(pb.req_to_token, rows, pb.prefix_lens) == 33
    assert torch_extend.shared_prefix_len(pb.req_to_token, rows[:1], pb.prefix_lens[:1]) == 0
    pb = _batch("prefix", 1, torch.float32, seed=0)  # one request has no prefix: nothing shared
    assert torch_extend.shared_prefix_len(pb.req_to_token, pb.req_pool_indices.tolist(), pb.prefix_lens) == 0


def test_unsupported_dtype_falls_back_to_reference():
    """float64 is not a flash case here: the reference computes it, in float64."""
    pb = _batch("prefix", 1, torch.float64, seed=1)
    q = torch.randn(sum(pb.extend_lens), HKV * 3, D, dtype=torch.float64)
    got = torch_extend.extend_attention(
        q,
        pb.k_cache[0],
        pb.v_cache[0],
        pb.req_to_token,
        pb.req_pool_indices,
        pb.prefix_lens,
        pb.extend_lens,
        D**-0.5,
    )
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _reference(pb, q), atol=0, rtol=0)
