"""Flash-decoding over the paged pool (GQA), as kernels.ref.decode_attention.

Stage 1, grid (B, Hkv, S): request b's seq_len keys are cut into S splits of cdiv(seq_len, S) positions;
each program attends all GROUP query heads that share kv head `kvh` over one split (keys read through
req_to_token, so any slot layout works) and writes a normalized partial output and its log-sum-exp
into mid_o [B, Hq, S, D] / mid_lse [B, Hq, S] (float32).
Stage 2, grid (B, Hq): merges the non-empty splits by their log-sum-exp.
The grid depends only on (B, Hkv, S), never on lengths, so the launch is CUDA-graph friendly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, mid_o_ptr, mid_lse_ptr,
    r2t_ptr, rpi_ptr, slen_ptr,
    stride_qb, stride_qh, stride_cs, stride_ch, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    slen = tl.load(slen_ptr + b).to(tl.int32)
    split_len = tl.cdiv(slen, NUM_SPLITS)
    lo = s * split_len
    hi = tl.minimum(lo + split_len, slen)
    if lo < hi:
        row = tl.load(rpi_ptr + b).to(tl.int64)
        offs_g = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + offs_g
        mask_h = offs_g < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :], other=0.0,
        )  # [H, Dp]
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(r2t_ptr + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_off = slots * stride_cs + kvh * stride_ch
            k = tl.load(
                kc_ptr + kv_off[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0
            )  # [Dp, N]
            qk = tl.dot(q, k, input_precision=PRECISION) * scale  # [H, N]
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                vc_ptr + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
            )  # [N, Dp]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        o = acc / l_i[:, None]
        o_off = b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + offs_d[None, :]
        tl.store(mid_o_ptr + o_off, o, mask=mask_h[:, None] & mask_d[None, :])
        lse_off = b * stride_lb + heads * stride_lh + s
        tl.store(mid_lse_ptr + lse_off, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, slen_ptr,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slen = tl.load(slen_ptr + b).to(tl.int32)
    split_len = tl.cdiv(slen, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    m = tl.full([], -1.0e30, tl.float32)
    l_sum = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        if s * split_len < slen:  # split s is non-empty, so stage 1 wrote it
            lse = tl.load(mid_lse_ptr + b * stride_lb + h * stride_lh + s)
            o = tl.load(mid_o_ptr + b * stride_mb + h * stride_mh + s * stride_ms + offs_d, mask=mask_d, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * o
            l_sum = l_sum * alpha + w
            m = m_new
    out = acc / l_sum
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int = 8,
    mid: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """q: [B, Hq, D], one new token per request (its K/V already stored); seq_lens: [B] int tensor.

    mid: optional preallocated (mid_o [>=B, Hq, S, D], mid_lse [>=B, Hq, S]) float32 scratch, S = num_kv_splits.
    Returns [B, Hq, D] in q's dtype.
    """
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0 and q.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    group = hq // hkv
    if out is None:
        out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    if mid is None:
        mid = alloc_decode_scratch(bsz, hq, d, num_kv_splits, q.device)
    mid_o, mid_lse = mid
    assert mid_o.shape[2] == num_kv_splits and mid_lse.shape[2] == num_kv_splits
    block_d = max(16, triton.next_power_of_2(d))
    _decode_split_kernel[(bsz, hkv, num_kv_splits)](
        q, k_cache, v_cache, mid_o, mid_lse,
        req_to_token, req_pool_indices, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        scale,
        GROUP=group, D=d, BLOCK_D=block_d, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, NUM_SPLITS=num_kv_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    _decode_reduce_kernel[(bsz, hq)](
        mid_o, mid_lse, out, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        D=d, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits,
    )
    return out


def alloc_decode_scratch(
    max_batch: int, num_q_heads: int, head_dim: int, num_kv_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 (mid_o [B, Hq, S, D], mid_lse [B, Hq, S]) for decode_attention's split partials."""
    mid_o = torch.empty((max_batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((max_batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse
