"""Weight-only quantization: GGUF blocks kept quantized, round-to-nearest on load, and the kernels that run them.

Data flow: the loader hands each linear weight here once, either as GGUF blocks (`from_gguf`) or as a float tensor to
quantize (`quantize`); `to_kernel` turns that into a QuantWeight module in the device's kernel layout, which
the model calls through `linear(x, w)` exactly like a dense weight. In between, a weight travels as a QTensor
(codes + float32 group scales on the host), which can be fused along rows (QKV, gate/up) before packing. Modules:
  gguf_blocks  GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K bytes <-> codes + block parameters (exact both ways)
  rtn          round-to-nearest int4 / int8 / fp8 with group scales, and the float32 references
  weights      Int4Weight / Int8Weight / Fp8Weight (CPU torch ops, CUDA Triton) and `linear`
  cpu_blocks   Q4BlockWeight / Q8BlockWeight: GGUF-style blocks for kernels/cpu's native GEMV (CPU decode)
  triton_mm    the Triton dequant-matmul kernel (GPU; CPU interpreter in tests)
  w8a8         W8A8Weight: int8 weights x per-token int8 activations (CPU int8 arithmetic for calls of many rows)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.quant import gguf_blocks, rtn
from kernels.quant.cpu_blocks import Q4BlockWeight, Q8BlockWeight, set_cpu_kernel, use_native
from kernels.quant.w8a8 import W8A8Weight, wrap_linears
from kernels.quant.weights import (
    CPU_ACT,
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    PanelWeight,
    QuantWeight,
    keep_dense_copies,
    linear,
    pack_dense_panels,
    weight_nbytes,
)

MODES = ("none", "int8", "int4", "fp8")

__all__ = [
    "MODES", "Fp8Weight", "Int4Weight", "Int8Weight", "PanelWeight", "Q4BlockWeight", "Q8BlockWeight", "QTensor",
    "QuantEmbedding", "QuantWeight", "cat_rows", "embedding", "from_gguf", "keep_dense_copies", "linear",
    "pack_dense_panels", "quantize", "set_cpu_kernel", "to_kernel", "W8A8Weight", "weight_nbytes", "wrap_linears",
]


@dataclass
class QTensor:
    """A quantized weight on the host in its logical form, before packing for a kernel.
    int4: codes uint8 [N, K] 0..15, value = (q - 8) * scale + zero; int8 / fp8: value = q * scale.
    scale, zero: float32 [N, K / G]. `origin` says where it came from ("Q4_1", "Q8_0", "rtn", ...)."""

    kind: str  # "int4" | "int8" | "fp8"
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    origin: str = "rtn"

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def permute_rows(self, fn) -> QTensor:
        """Apply one row permutation `fn` (numpy [N, ...] -> [N, ...]) to codes and scales alike."""
        def f(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.float8_e4m3fn:
                return torch.from_numpy(fn(t.view(torch.uint8).numpy()).copy()).view(torch.float8_e4m3fn)
            return torch.from_numpy(np.ascontiguousarray(fn(t.numpy())))
        zero = None if self.zero is None else f(self.zero)
        return QTensor(self.kind, f(self.codes), f(self.scale), zero, self.origin)

    def dequantize(self) -> torch.Tensor:
        if self.kind == "int4":
            assert self.zero is not None  # every int4 QTensor has zero points
            return rtn.dequantize_int4(self.codes, self.scale, self.zero)
        return rtn.dequantize_scaled(self.codes, self.scale)


def cat_rows(parts: list[QTensor]) -> QTensor:
    """Stack weights along N (fused QKV, gate/up); all parts share kind and group size."""
    kinds = {(p.kind, p.group) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse quantized weights of different kinds/groups: {sorted(kinds)}")
    # parts share one kind, so either all have zero points (int4) or none does
    zero = None if parts[0].zero is None else torch.cat(cast("list[torch.Tensor]", [p.zero for p in parts]))
    origin = "+".join(sorted({p.origin for p in parts}))
    return QTensor(parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   zero, origin)


def quantize(w: torch.Tensor, mode: str, group: int) -> QTensor:
    """Round-to-nearest quantize a float weight [N, K] on load. int4: asymmetric, `group` inputs per scale;
    int8: symmetric per output channel; fp8 (CUDA): e4m3 per output channel."""
    if mode == "int4":
        return QTensor("int4", *rtn.quantize_int4(w, group))
    if mode == "int8":
        return QTensor("int8", *rtn.quantize_int8(w))
    if mode == "fp8":
        return QTensor("fp8", *rtn.quantize_fp8(w))
    raise ValueError(f"unknown quantization {mode!r} ({', '.join(MODES)})")


def from_gguf(blocks: gguf_blocks.Blocks) -> QTensor:
    """A GGUF tensor kept quantized, same codes: 4-bit kinds -> int4 group 32; Q8_0 -> int8 group 32."""
    if blocks.kind == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(blocks.codes))
        return QTensor("int8", codes, torch.from_numpy(blocks.params["d"].astype(np.float32)), origin="Q8_0")
    return QTensor("int4", *gguf_blocks.group_affine(blocks), origin=blocks.kind)


def to_kernel(q: QTensor, device: torch.device | str, exact: bool = False) -> QuantWeight:
    """Pack a QTensor into the device's kernel layout. On CPU: kernels/quant/cpu_blocks.py's block layouts where
    the native kernels run (set_cpu_kernel), codes kept exactly; else torch's, where an int8 weight with group
    scales (GGUF Q8_0) is re-rounded to one scale per output channel (torch's CPU int8 kernel has no groups):
    codes change by at most half a per-channel step. `exact` (the tied 262k-vocabulary Gemma head, whose rows
    mix blocks of very different scales: re-rounding moves its logits by 4e-2 relative) keeps group scales: the
    native q8 kernel wherever it runs (auto on AVX-512 included), else torch's int8 kernel on two per-channel
    terms, the re-rounded codes and the codes of what they miss (two calls; values within 1/200 of a step)."""
    cpu = torch.device(device).type == "cpu"
    if cpu and q.kind in ("int4", "int8") and use_native(q.shape[1], q.group, q.kind, exact and q.kind == "int8"):
        if q.kind == "int4":
            assert q.zero is not None  # every int4 QTensor has zero points
            return Q4BlockWeight(q.codes, q.scale, q.zero)
        return Q8BlockWeight(q.codes, q.scale)
    if q.kind == "int4":
        assert q.zero is not None
        return Int4Weight(q.codes, q.scale, q.zero, device)
    if q.kind == "int8":
        if torch.device(device).type != "cuda" and q.group != q.shape[1]:
            w = q.dequantize()
            codes, scale = rtn.quantize_int8(w)
            rest = rtn.quantize_int8(w - rtn.dequantize_scaled(codes, scale.to(CPU_ACT).float())) if exact else None
            return Int8Weight(codes, scale, device, rest=rest)
        return Int8Weight(q.codes, q.scale, device)
    if q.kind == "fp8":
        return Fp8Weight(q.codes, q.scale, device)
    raise ValueError(f"unknown quantized kind {q.kind!r}")


class QuantEmbedding(nn.Module):
    """An embedding table kept as int8 codes [V, H] + float32 group scales [V, H / G] (GGUF Q8_0); a lookup
    dequantizes only the gathered rows, to the file's exact values in float32 (then `dtype`)."""

    codes: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, q: QTensor, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        if q.kind != "int8":
            raise ValueError(f"QuantEmbedding keeps int8 tables only, got {q.kind}")
        self.dtype = dtype
        self.register_buffer("codes", q.codes.to(device))
        self.register_buffer("scale", q.scale.to(device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.codes[ids].float()  # [T, H]
        s = self.scale[ids]  # [T, H / G]
        return (q.view(*q.shape[:-1], s.shape[-1], -1) * s[..., None]).reshape(q.shape).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.forward(torch.arange(self.codes.shape[0], device=self.codes.device)).float()


def embedding(ids: torch.Tensor, table: torch.Tensor | QuantEmbedding) -> torch.Tensor:
    """Rows of a dense table [V, H] or a QuantEmbedding."""
    return F.embedding(ids, table) if isinstance(table, torch.Tensor) else table(ids)
