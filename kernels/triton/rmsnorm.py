"""Fused residual add + RMSNorm, as kernels.ref.rmsnorm: h = x + residual; out = rmsnorm(h) * weight.

One program per row; the row (hidden size H) fits one block. Math in float32; h is rounded to x's dtype
before normalizing, exactly as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, h_ptr,
    stride_x, stride_r, stride_o, stride_h,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = hf * tl.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H]; weight: [H]. Returns (normed [..., H] in x's dtype, h = x + residual or x)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.stride(-1) == 1
    out = torch.empty_like(x2)
    if residual is None:
        r2, h2 = x2, x2
    else:
        r2 = residual.reshape(-1, n)
        assert r2.stride(-1) == 1
        h2 = torch.empty_like(x2)
    rows = x2.shape[0]
    if rows:
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight, out, h2,
            x2.stride(0), r2.stride(0), out.stride(0), h2.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
        )
    h = x if residual is None else h2.view(x.shape)
    return out.view(x.shape), h
