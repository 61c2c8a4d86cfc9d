"""Store new K/V rows into the paged pool: k_cache[loc[t]] = k[t] (one layer).

Any slot layout works (page size 1 or P): `loc` names each token's slot directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    D: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per new token t: copies its [Hkv, D] K and V rows into slot loc[t].
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HD
    h = offs // D
    d = offs % D
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * stride_cs + h * stride_ch + d
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_cache, v_cache: [num_slots, Hkv, D] (one layer, last dim contiguous); loc: [T]; k, v: [T, Hkv, D]."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        D=d, HD=hkv * d, BLOCK=triton.next_power_of_2(hkv * d),
    )
