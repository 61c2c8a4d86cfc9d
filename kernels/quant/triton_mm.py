"""GPU weight-only dequant-matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, in one Triton kernel.

Weight layouts (all row-major over N, scale groups of G consecutive K per row):
  INT4: packed uint8 [N, K / 2], byte j of a row holds k = 2j (low nibble) and k = 2j + 1 (high nibble);
        scale, zero [N, K / G]; w = (q - 8) * scale + zero.
  INT8: int8 [N, K]; scale [N, K / G]; w = q * scale.
  FP8:  float8_e4m3fn bits as uint8 [N, K]; scale [N, K / G]; w = fp8(q) * scale.
G = K is one scale per output channel. Dequantization and accumulation are float32; the weight tile is cast to
x's dtype before tl.dot (bf16/fp16 tensor cores; float32 x uses IEEE fp32 dot). Runs under TRITON_INTERPRET=1
on CPU for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT4, INT8, FP8 = 0, 1, 2


@triton.jit
def _dequant_mm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K, G,
    stride_xm, stride_ym, stride_w, stride_s,
    MODE: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wmask = n_mask[:, None] & k_mask[None, :]
        grp = kk // G
        s = tl.load(s_ptr + rn[:, None] * stride_s + grp[None, :], mask=wmask, other=0.0)
        if MODE == 0:
            byte = tl.load(w_ptr + rn[:, None] * stride_w + (kk // 2)[None, :], mask=wmask, other=0)
            q = ((byte >> ((kk % 2) * 4)[None, :]) & 0xF).to(tl.float32)
            z = tl.load(z_ptr + rn[:, None] * stride_s + grp[None, :], mask=wmask, other=0.0)
            w = (q - 8.0) * s + z
        elif MODE == 1:
            q = tl.load(w_ptr + rn[:, None] * stride_w + kk[None, :], mask=wmask, other=0)
            w = q.to(tl.float32) * s
        else:
            bits = tl.load(w_ptr + rn[:, None] * stride_w + kk[None, :], mask=wmask, other=0)
            w = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        w = w.to(x.dtype)  # [BN, BK]
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


def dequant_mm(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, mode: int, n: int,
) -> torch.Tensor:
    """x: [M, K] (contiguous rows); w: packed weight per MODE; scale/zero: [N, K / G]. Returns [M, N] in x's
    dtype. G is K / scale.shape[1]; BK divides G whenever G < K so a tile never straddles two groups badly
    (a straddling tile is still correct: the group index is computed per column)."""
    m, k = x.shape
    groups = scale.shape[1]
    g = k // groups
    assert scale.shape == (n, groups) and k % groups == 0
    assert x.stride(1) == 1 and w.stride(1) == 1 and scale.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bk = 64, 32 if g % 64 else 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    z = scale if zero is None else zero
    _dequant_mm_kernel[grid](
        x, w, scale, z, y,
        m, n, k, g,
        x.stride(0), y.stride(0), w.stride(0), scale.stride(0),
        MODE=mode, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk,
    )
    return y


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 -> [N, K / 2] uint8 (k even in the low nibble)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
