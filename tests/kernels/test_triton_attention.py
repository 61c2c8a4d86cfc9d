"""Triton extend and decode attention vs kernels.ref, fp32, small ragged shapes.

Grid: GQA ratios 1, 3 and 8; page sizes 1 and 16 (pages scattered in the pool); head_dim 16 and 32;
ragged lengths including prefix 0, extend 1 and lengths that span several key/query blocks.
Tolerance: fp32, atol = rtol = 1e-4 (online softmax reorders the sums; exact math would match to ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from kernels import ref
from tests.kernels.paged import make_paged_batch, qo_start

pytest.importorskip("triton")

from kernels.triton.decode_attention import decode_attention  # noqa: E402
from kernels.triton.extend_attention import extend_attention  # noqa: E402

ATOL = RTOL = 1e-4
HEADS = [(4, 4), (6, 2), (8, 1)]  # (Hq, Hkv): GQA ratios 1, 3, 8
RAGGED = [
    ([0, 7, 33, 0], [1, 18, 5, 40]),  # prefix 0 with extend 1, long extend spanning query blocks
    ([20, 0, 1], [1, 3, 16]),  # extend 1 over a prefix (decode-like), exact block edge
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("lens", RAGGED)
def test_extend_matches_ref(device: str, page_size: int, hq: int, hkv: int, lens) -> None:
    prefix, extend = lens
    d = 32 if hkv == 2 else 16
    pb = make_paged_batch(prefix, extend, hkv, d, page_size=page_size, device=device, seed=hq + page_size)
    kc, vc = pb.k_cache[0], pb.v_cache[0]
    q = torch.randn(sum(extend), hq, d, generator=torch.Generator().manual_seed(1)).to(device)
    scale = d**-0.5
    e = torch.tensor(extend, device=device)
    p = torch.tensor(prefix, device=device)
    got = extend_attention(
        q, kc, vc, pb.req_to_token, pb.req_pool_indices, p, e, qo_start(pb.extend_lens, device),
        max(extend), scale, block_m=16, block_n=16,
    )
    want = ref.extend_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, pb.prefix_lens, pb.extend_lens, scale)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_extend_default_blocks_noncontiguous_q(device: str) -> None:
    """Default 64x64 blocks, q a strided view (as after splitting a fused qkv projection)."""
    hq, hkv, d = 6, 2, 16
    prefix, extend = [70, 0], [9, 66]
    pb = make_paged_batch(prefix, extend, hkv, d, page_size=16, device=device, seed=3)
    kc, vc = pb.k_cache[0], pb.v_cache[0]
    qkv = torch.randn(sum(extend), hq + 2 * hkv, d, generator=torch.Generator().manual_seed(2)).to(device)
    q = qkv[:, :hq]
    got = extend_attention(
        q, kc, vc, pb.req_to_token, pb.req_pool_indices, torch.tensor(prefix, device=device),
        torch.tensor(extend, device=device), qo_start(pb.extend_lens, device), max(extend), 0.3,
    )
    want = ref.extend_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, pb.prefix_lens, pb.extend_lens, 0.3)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("num_kv_splits", [1, 8])
def test_decode_matches_ref(device: str, page_size: int, hq: int, hkv: int, num_kv_splits: int) -> None:
    # seq_lens 1 and 3 leave most of the 8 splits empty; 75 spans several key blocks per split.
    prefix = [0, 2, 74, 16, 40]
    extend = [1] * len(prefix)
    d = 32 if hkv == 2 else 16
    pb = make_paged_batch(prefix, extend, hkv, d, page_size=page_size, device=device, seed=hq * 7 + page_size)
    kc, vc = pb.k_cache[0], pb.v_cache[0]
    q = torch.randn(len(prefix), hq, d, generator=torch.Generator().manual_seed(4)).to(device)
    seq = torch.tensor(pb.seq_lens, device=device)
    got = decode_attention(
        q, kc, vc, pb.req_to_token, pb.req_pool_indices, seq, 0.25, num_kv_splits=num_kv_splits, block_n=16
    )
    want = ref.decode_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, 0.25)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_decode_scratch_reused_for_smaller_batch(device: str) -> None:
    """A scratch buffer sized for a bigger batch (as the backend keeps) gives the same result."""
    from kernels.triton.decode_attention import alloc_decode_scratch

    hq, hkv, d = 6, 2, 16
    pb = make_paged_batch([5, 130], [1, 1], hkv, d, device=device, seed=9)
    kc, vc = pb.k_cache[0], pb.v_cache[0]
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(5)).to(device)
    mid = alloc_decode_scratch(16, hq, d, 4, device)
    seq = torch.tensor(pb.seq_lens, device=device)
    got = decode_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, seq, 0.25, num_kv_splits=4, mid=mid)
    want = ref.decode_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, 0.25)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
