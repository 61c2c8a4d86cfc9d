"""Round-to-nearest weight quantizers (quantize on load): float weights [N, K] -> codes + scales.

Every function returns the same "logical" form the kernels' packers take, so a checkpoint quantized here and a
GGUF kept quantized go through one path:
  int4: codes uint8 [N, K] in 0..15, scale, zero float32 [N, K / group]; value = (q - 8) * scale + zero
        (asymmetric min/max per group, like GGUF Q4_1).
  int8: codes int8 [N, K] in -127..127, scale float32 [N, K / group]; value = q * scale (symmetric absmax;
        group = K is per output channel).
  fp8:  codes float8_e4m3fn [N, K], scale float32 [N, K / group]; value = float(code) * scale (absmax -> 448).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the quantization group {group}")
    return w.float().reshape(n, k // group, group)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _groups(w, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    zero = lo + 8.0 * scale
    return codes.reshape(w.shape), scale, zero


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = _groups(w, group or w.shape[1])
    scale = g.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(w.shape), scale


def quantize_fp8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = _groups(w, group or w.shape[1])
    scale = g.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (g / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(w.shape), scale


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The reference: float32 [N, K]."""
    n, k = codes.shape
    g = codes.reshape(n, scale.shape[1], -1).float()
    return ((g - 8.0) * scale[..., None] + zero[..., None]).reshape(n, k)


def dequantize_scaled(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 or fp8 codes times their group scales: float32 [N, K]."""
    n, k = codes.shape
    return (codes.float().reshape(n, scale.shape[1], -1) * scale[..., None]).reshape(n, k)
