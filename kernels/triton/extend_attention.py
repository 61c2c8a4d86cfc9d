"""Ragged extend attention over the paged pool (GQA), as kernels.ref.extend_attention.

Request b's E_b new queries sit at q[qo_start[b] : qo_start[b] + E_b]; their positions are
prefix_len[b] .. prefix_len[b] + E_b - 1. The new K/V are already stored in the pool, so every key
(cached prefix and new tokens alike) is read through req_to_token[row_b, pos] -> slot, which makes the
kernel independent of the slot layout (page size 1 or P). Query at position i sees keys at positions <= i.

Grid (B, Hq, cdiv(max E_b, BLOCK_M)); each program runs an online softmax over key blocks of BLOCK_N,
stopping at the last key its query block can see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _extend_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr,
    r2t_ptr, rpi_ptr, plen_ptr, elen_ptr, qstart_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cs, stride_ch, stride_r2t,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    elen = tl.load(elen_ptr + b).to(tl.int32)
    if mb * BLOCK_M < elen:
        plen = tl.load(plen_ptr + b).to(tl.int32)
        qs = tl.load(qstart_ptr + b).to(tl.int64)
        row = tl.load(rpi_ptr + b).to(tl.int64)
        kvh = h // GROUP

        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < elen
        mask_d = offs_d < D
        q_off = (qs + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, Dp]
        qpos = plen + offs_m  # [M] absolute positions

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = plen + tl.minimum((mb + 1) * BLOCK_M, elen)  # keys past this are invisible to the block
        for start in range(0, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(r2t_ptr + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_off = slots * stride_cs + kvh * stride_ch
            k = tl.load(
                kc_ptr + kv_off[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0
            )  # [Dp, N]
            qk = tl.dot(q, k, input_precision=PRECISION) * scale  # [M, N] fp32
            visible = mask_n[None, :] & (offs_n[None, :] <= qpos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                vc_ptr + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
            )  # [N, Dp]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        o_off = (qs + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    max_extend_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache, v_cache: [num_slots, Hkv, D] (one layer; new K/V already stored).

    prefix_lens, extend_lens, qo_start (exclusive cumsum of extend_lens): [B] int tensors on q's device;
    max_extend_len: max(extend_lens) on the host (sizes the grid). Returns [T, Hq, D] in q's dtype.
    """
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0 and q.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    b = req_pool_indices.shape[0]
    if t == 0 or b == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    grid = (b, hq, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, qo_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        scale,
        GROUP=hq // hkv, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
