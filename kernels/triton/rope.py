"""Neox-style (rotate-half) rotary embedding, as kernels.ref.apply_rope.

cos_sin: [max_pos, D] float32, first half cos, second half sin (kernels.ref.rope_cos_sin).
Per token t at position p: out[..., :D/2] = x1*cos - x2*sin; out[..., D/2:] = x2*cos + x1*sin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, pos_ptr, cs_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
    H, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # Grid (T, cdiv(H, BLOCK_H)): one token, a block of heads, all of head_dim.
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    mask = (offs_h[:, None] < H) & mask_d[None, :]
    src = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, o1.to(ty), mask=mask)
    tl.store(dst + HALF, o2.to(ty), mask=mask)


def _rope_one(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    assert x.stride(2) == 1 and cos_sin.stride(1) == 1 and d % 2 == 0 and cos_sin.shape[1] == d
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_h = min(triton.next_power_of_2(h), 16)
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, out, positions, cos_sin,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin.stride(0),
        h, HALF=d // 2, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(d // 2),
    )
    return out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T]. Returns new rotated (q, k) in their dtypes."""
    return _rope_one(q, positions, cos_sin), _rope_one(k, positions, cos_sin)
