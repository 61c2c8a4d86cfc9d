"""Weight-only quantization: GGUF blocks kept quantized, round-to-nearest on load, and the kernels that run them.

Data flow: the loader hands each linear weight here once, either as GGUF block bytes (`from_gguf`) or as a float
tensor to quantize (`quantize`); what comes back is a QuantWeight module in the device's kernel layout, which
the model calls through `linear(x, w)` exactly like a dense weight. Modules:
  gguf_blocks  GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K bytes <-> codes + block parameters (exact both ways)
  rtn          round-to-nearest int4 / int8 / fp8 with group scales, and the float32 references
  weights      Int4Weight / Int8Weight / Fp8Weight (CPU torch ops, CUDA Triton) and `linear`
  triton_mm    the Triton dequant-matmul kernel (GPU; CPU interpreter in tests)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kernels.quant import gguf_blocks, rtn
from kernels.quant.weights import Fp8Weight, Int4Weight, Int8Weight, QuantWeight, linear, weight_nbytes

MODES = ("none", "int8", "int4", "fp8")

__all__ = [
    "MODES", "Fp8Weight", "Int4Weight", "Int8Weight", "QuantEmbedding", "QuantWeight",
    "from_gguf", "linear", "quantize", "weight_nbytes",
]


def quantize(w: torch.Tensor, mode: str, group: int, device: torch.device | str) -> QuantWeight:
    """Round-to-nearest quantize a float weight [N, K] on load. int4: asymmetric, `group` inputs per scale;
    int8: symmetric per output channel; fp8 (CUDA): e4m3 per output channel."""
    if mode == "int4":
        return Int4Weight(*rtn.quantize_int4(w, group), device)
    if mode == "int8":
        return Int8Weight(*rtn.quantize_int8(w), device)
    if mode == "fp8":
        return Fp8Weight(*rtn.quantize_fp8(w), device)
    raise ValueError(f"unknown quantization {mode!r} ({', '.join(MODES)})")


def from_gguf(blocks: gguf_blocks.Blocks, device: torch.device | str) -> QuantWeight:
    """A GGUF tensor kept quantized: 4-bit kinds -> Int4Weight (group 32, same codes); Q8_0 -> Int8Weight with
    its per-32 scales on CUDA, re-rounded to per-channel scales on CPU (the CPU int8 kernel has no groups)."""
    if blocks.kind == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(blocks.codes))
        d = torch.from_numpy(blocks.params["d"].astype(np.float32))
        if torch.device(device).type == "cuda":
            return Int8Weight(codes, d, device)
        return Int8Weight(*rtn.quantize_int8(rtn.dequantize_scaled(codes, d)), device)
    return Int4Weight(*gguf_blocks.group_affine(blocks), device)


class QuantEmbedding(nn.Module):
    """An embedding table kept as Q8_0 codes (int8 [V, H]) + f16 block scales [V, H / 32]; a lookup dequantizes
    only the gathered rows, to the file's exact values in float32 (then `dtype`)."""

    def __init__(self, blocks: gguf_blocks.Blocks, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        if blocks.kind != "Q8_0":
            raise ValueError(f"QuantEmbedding keeps Q8_0 tables only, got {blocks.kind}")
        self.dtype = dtype
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(blocks.codes)).to(device))
        self.register_buffer("d", torch.from_numpy(blocks.params["d"].copy()).to(device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.codes[ids].float()  # [T, H]
        d = self.d[ids].float()  # [T, H / 32]
        return (q.view(*q.shape[:-1], d.shape[-1], -1) * d[..., None]).reshape(q.shape).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.forward(torch.arange(self.codes.shape[0], device=self.codes.device)).float()
