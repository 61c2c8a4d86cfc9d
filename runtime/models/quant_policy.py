"""Which weights a --quantization mode keeps or makes quantized, and in what form (used by the loader).

Inputs: one tensor at a time as the loader reads it, either GGUF blocks or a float tensor, with its Hugging Face
name. Output: the tensor to put in the state dict, a float tensor or a kernels.quant.QTensor (packed for the
device later, by the model). Rules:
  linears (q/k/v/o, gate/up/down)
    gguf  GGUF Q4_0/Q4_1/Q4_K -> int4 (same codes, group 32), Q8_0 -> int8 (same codes); other types dense
          (what --quantization auto resolves to for a GGUF on CPU; the loader sees resolved modes only)
    int4  as gguf, and every other linear round-to-nearest int4 (group --quantization-group-size)
    int8  Q8_0 kept; every other linear (4-bit GGUF values included) round-to-nearest int8 per channel
    fp8   every linear e4m3 per output channel (CUDA)
    w8a8_int8  loads as gguf for GGUF blocks and as int8 for float linears (`base_mode`); the model runner then
          gives every quantized linear int8 codes per output channel for calls of many rows (kernels/quant/w8a8.py)
  embedding: a GGUF Q8_0 table stays Q8_0 (rows dequantized on lookup, exact); any other table stays dense.
  lm_head: int8 (Q8_0 codes when the file has them; per output channel on CPU) in gguf/int4/int8, fp8 in fp8.
  norms and biases: dense float32 / the model dtype, always.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from kernels.quant import QTensor, from_gguf, gguf_blocks, quantize

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class UnsupportedQuantization(ValueError):
    pass


def is_quantizable(name: str) -> bool:
    return bool(LINEAR.fullmatch(name)) or name in (EMBED, LM_HEAD)


W8A8 = "w8a8_int8"


def base_mode(mode: str, from_blocks: bool) -> str:
    """The weight-only mode a tensor loads under: w8a8_int8 keeps GGUF blocks as gguf does (the small-batch
    kernels read them) and rounds float linears to int8 per channel; every other mode is its own."""
    if mode != W8A8:
        return mode
    return "gguf" if from_blocks else "int8"


def gguf_tensor(name: str, raw: np.ndarray, kind: str, mode: str, group: int) -> QTensor | None:
    """A GGUF tensor of a kept kind (raw block bytes [N, row_bytes]) under `mode`, or None when the caller
    should dequantize it and go through `dense_tensor` (not quantizable, mode none, or a kind not kept)."""
    mode = base_mode(mode, from_blocks=True)
    if mode == "none" or not is_quantizable(name) or kind not in gguf_blocks.KINDS:
        return None
    kept = from_gguf(gguf_blocks.unpack(raw, kind))
    if name == EMBED:
        return kept if kept.kind == "int8" else None
    if name == LM_HEAD:
        return _head(kept, None, mode)
    if mode in ("gguf", "int4") or (mode == "int8" and kept.kind == "int8"):
        return kept
    return quantize(kept.dequantize(), mode, group)


def dense_tensor(name: str, w: torch.Tensor, mode: str, group: int) -> torch.Tensor | QTensor:
    """A float tensor (safetensors, or a GGUF type that is not kept) quantized on load under `mode`."""
    mode = base_mode(mode, from_blocks=False)
    if mode in ("none", "gguf") or not is_quantizable(name) or name == EMBED:
        return w
    if name == LM_HEAD:
        return _head(None, w, mode)
    return quantize(w, mode, group)


def tied_head(embed: torch.Tensor | QTensor, mode: str) -> torch.Tensor | QTensor | None:
    """The lm_head of a tied model under `mode`: None means "reuse the dense embedding"."""
    mode = base_mode(mode, from_blocks=isinstance(embed, QTensor))
    if mode == "none" or (mode == "gguf" and not isinstance(embed, QTensor)):
        return None
    if isinstance(embed, QTensor):
        return _head(embed, None, mode)
    return _head(None, embed, mode)


def _head(kept: QTensor | None, w: torch.Tensor | None, mode: str) -> QTensor:
    if kept is not None and kept.kind == "int8" and mode != "fp8":
        return kept
    dense = kept.dequantize() if kept is not None else w
    assert dense is not None  # callers pass exactly one of kept, w
    return quantize(dense, "fp8" if mode == "fp8" else "int8", 0)


def describe(weights: dict) -> str:
    """One line on what was kept quantized: counts per (kind, origin)."""
    counts: dict[str, int] = {}
    for v in weights.values():
        if isinstance(v, QTensor):
            key = f"{v.kind}<-{v.origin}" + (f" g{v.group}" if v.group != v.shape[1] else " per-channel")
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items())) or "no quantized tensors"
