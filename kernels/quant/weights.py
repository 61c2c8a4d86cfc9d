"""Quantized linear weights kept quantized on the device, and `linear(x, w)` dispatching on the weight type.

Each weight is an nn.Module whose tensors are buffers (so a compiled forward sees them as module state) and whose
`forward(x)` computes x @ W^T for x [..., K] -> [..., N] in x's dtype. They are built once at load from the
"logical" form of kernels.quant.rtn (codes + float32 group scales) and repack it into the device's layout:

  CPU   Int4Weight: torch._convert_weight_to_int4pack_for_cpu layout (blocks of 64 output rows, k-major,
        row i and row i + 32 of a block share a byte) + scale_zero [K / G, N, 2] bfloat16, run by
        torch._weight_int4pack_mm_for_cpu on bfloat16 activations (its float32/float16 paths are 50-100x
        slower). Int8Weight: int8 [N, K] + per-channel bfloat16 scales, torch._weight_int8pack_mm.
  CUDA  Int4/Int8/Fp8Weight: kernels.quant.triton_mm layouts, float32 scales, one Triton dequant-matmul
        (`triton=True` selects it on CPU too, for the interpreter tests).
  (CPU, --quantization-kernel native, the default on AVX2 CPUs without AVX-512: kernels/quant/cpu_blocks.py's
  Q4BlockWeight / Q8BlockWeight, GGUF's own blocks for kernels/cpu/quant_gemv.cpp, instead of the two above.)

The CPU kernels need bfloat16 scales: a float16 GGUF scale keeps 8 of its 11 mantissa bits there (a relative
change <= 2^-9, far below the 4-bit grid's own rounding); codes are kept exactly. Both torch ops are ATen
ops with meta kernels, so torch.compile traces them (fullgraph).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import ops as cpu_ops  # the panel kernel of float32 linears on AVX2 CPUs (compiles nothing)
from kernels.quant import rtn

# Activation dtype of the CPU weight-only kernels, whatever the model's dtype: torch's int4/int8 CPU kernels take
# a slow path for float32 activations (measured once on an AVX2 EPYC without native bf16: a 1536x576 int4 call
# at 1 row 1.7 vs 0.094 ms, the int8 lm_head 13.5 vs 2.3 ms).
CPU_ACT = torch.bfloat16
# From this many rows on (prefill), the CPU path dequantizes the weight to the activations' dtype for the call and
# runs a dense GEMM: torch's weight-only kernels cost time linear in the rows (a GEMV loop; ~10x a dense bf16 GEMM at
# 1024 rows), while dequantizing costs one pass over the weight (bench/quant_kernels.py measures both).
# With a kept copy (keep_dense_copies) the crossover is the copy's own, much lower threshold.
CPU_DENSE_MIN_ROWS = 256


class QuantWeight(nn.Module):
    """Base: out_features N, in_features K; forward(x [..., K]) -> [..., N] in x.dtype.

    CPU layouts may also hold `dense`, a copy [N, K] of the dequantized weight in the model's dtype, or float32
    panels [N / 16, K, 16] of it (keep_dense_copies): calls with at least `dense_min_rows` rows then run one
    dense GEMM on it in that dtype, fewer rows the quantized kernel."""

    out_features: int
    in_features: int
    dense: torch.Tensor | None
    dense_min_rows: int = CPU_DENSE_MIN_ROWS
    # False: never a dense copy (keep_dense_copies) nor a dequantization of the whole weight per call; the
    # quantized kernel at every row count (the tied 262k-vocabulary head: a float32 copy would be 671 MB).
    dense_copies: bool = True

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized to `dtype` [N, K] (CPU layout; the arithmetic runs in `dtype`)."""
        raise NotImplementedError

    def _dense_mm(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] @ W^T as one dense GEMM from `dense_min_rows` rows on: on the kept copy (in its dtype), else
        on a dequantization for this call in x's dtype (float32 or bfloat16); None below (the quantized kernel)."""
        if x.shape[0] < self.dense_min_rows or not self.dense_copies:
            return None
        w = self.dense
        if w is None:
            w = self.dense_weight(x.dtype if x.dtype in (torch.float32, torch.bfloat16) else CPU_ACT)
        elif w.dim() == 3:  # float32 panels (keep_dense_copies on an AVX2 CPU)
            return cpu_ops.linear_panels(x.float(), w).to(x.dtype)
        return F.linear(x.to(w.dtype), w).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, float32 [N, K] (the tests' reference)."""
        raise NotImplementedError

    def takes_dense_copy(self) -> bool:
        """Whether keep_dense_copies gives this weight a dense copy (CPU layouts that dense_weight can unpack)."""
        return False

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._mm(x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def _is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


class Int4Weight(QuantWeight):
    """4-bit codes with an affine map per group of G inputs: w = (q - 8) * scale + zero."""

    packed: torch.Tensor  # buffers (register_buffer): scale/zero on the CUDA layout, scale_zero on CPU's
    scale: torch.Tensor
    zero: torch.Tensor
    scale_zero: torch.Tensor

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, device: torch.device | str,
                 triton: bool | None = None):
        super().__init__()
        n, k = codes.shape
        self.out_features, self.in_features = n, k
        self.group = k // scale.shape[1]
        self.cuda_layout = _is_cuda(device) if triton is None else triton
        self.unpackable = False  # CPU layout of whole blocks: codes() and dense_weight() can unpack it
        if self.cuda_layout:
            from kernels.quant.triton_mm import pack_int4_rows

            self.register_buffer("packed", pack_int4_rows(codes).to(device))  # [N, K / 2]
            self.register_buffer("scale", scale.float().contiguous().to(device))  # [N, K / G]
            self.register_buffer("zero", zero.float().contiguous().to(device))
        else:
            if self.group not in (32, 64, 128, 256) or k % 2:
                raise ValueError(f"CPU int4 kernel needs group 32/64/128/256 and even K, got G={self.group} K={k}")
            packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            self.unpackable = n % cpu_int4_block_n() == 0
            self.register_buffer("packed", packed)  # [N, K / 2] uint8, blocked layout
            sz = torch.stack([scale.float().t(), zero.float().t()], dim=-1)  # [K / G, N, 2]
            self.register_buffer("scale_zero", sz.to(CPU_ACT).contiguous())
        self.register_buffer("dense", None)

    def takes_dense_copy(self) -> bool:
        return not self.cuda_layout and self.unpackable

    def codes(self) -> torch.Tensor:
        """Unpack the kernel layout back to uint8 codes [N, K] (exact)."""
        if self.cuda_layout:
            from kernels.quant.triton_mm import unpack_int4_rows

            return unpack_int4_rows(self.packed)
        return unpack_cpu_int4(self.packed, self.out_features, self.in_features)

    def scale_zero_f32(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cuda_layout:
            return self.scale, self.zero
        return self.scale_zero[..., 0].float().t(), self.scale_zero[..., 1].float().t()

    def dequantize(self) -> torch.Tensor:
        scale, zero = self.scale_zero_f32()
        return rtn.dequantize_int4(self.codes().cpu(), scale.cpu(), zero.cpu())

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda_layout:
            from kernels.quant.triton_mm import INT4, dequant_mm

            return dequant_mm(x.contiguous(), self.packed, self.scale, self.zero, INT4, self.out_features)
        y = self._dense_mm(x) if self.unpackable else None
        if y is not None:
            return y
        y = torch._weight_int4pack_mm_for_cpu(x.to(CPU_ACT), self.packed, self.group, self.scale_zero)
        return y.to(x.dtype)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        codes = unpack_cpu_int4(self.packed, n, k).reshape(n, k // self.group, self.group).to(dtype)
        sz = self.scale_zero.transpose(0, 1).to(dtype)  # [N, K / G, 2]
        return torch.addcmul(sz[..., 1:], codes - 8, sz[..., :1]).reshape(n, k)


class Int8Weight(QuantWeight):
    """int8 codes times group scales: w = q * scale. On CPU only per-channel scales (G = K) are supported, and
    optionally a second per-channel term `rest` (codes2, scale2): w = q * scale + q2 * scale2, two kernel calls
    (a GGUF Q8_0 weight whose block scales must survive torch's per-channel kernel: kernels.quant.to_kernel)."""

    codes: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor
    codes2: torch.Tensor | None
    scale2: torch.Tensor | None

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, device: torch.device | str,
                 triton: bool | None = None, rest: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        n, k = codes.shape
        self.out_features, self.in_features = n, k
        self.group = k // scale.shape[1]
        self.cuda_layout = _is_cuda(device) if triton is None else triton
        if not self.cuda_layout and self.group != k:
            raise ValueError(f"CPU int8 kernel takes one scale per output channel, got groups of {self.group}")
        self.register_buffer("codes", codes.to(torch.int8).contiguous().to(device))  # [N, K]
        dtype = torch.float32 if self.cuda_layout else CPU_ACT
        self.register_buffer("scale", scale.to(dtype).contiguous().to(device))  # [N, K / G]
        if rest is not None and self.cuda_layout:
            raise ValueError("a second int8 term is for CPU's per-channel kernel only")
        self.register_buffer("codes2", None if rest is None else rest[0].to(torch.int8).contiguous().to(device))
        self.register_buffer("scale2", None if rest is None else rest[1].to(dtype).contiguous().to(device))
        self.register_buffer("dense", None)

    def dequantize(self) -> torch.Tensor:
        w = rtn.dequantize_scaled(self.codes.cpu(), self.scale.float().cpu())
        if self.codes2 is not None and self.scale2 is not None:
            w = w + rtn.dequantize_scaled(self.codes2.cpu(), self.scale2.float().cpu())
        return w

    def takes_dense_copy(self) -> bool:
        return not self.cuda_layout

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.codes.to(dtype) * self.scale.to(dtype)
        if self.codes2 is not None and self.scale2 is not None:
            w = w + self.codes2.to(dtype) * self.scale2.to(dtype)
        return w

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda_layout:
            from kernels.quant.triton_mm import INT8, dequant_mm

            return dequant_mm(x.contiguous(), self.codes, self.scale, None, INT8, self.out_features)
        y = self._dense_mm(x)
        if y is not None:
            return y
        xa = x.to(CPU_ACT)
        y = torch._weight_int8pack_mm(xa, self.codes, self.scale[:, 0])
        if self.codes2 is not None and self.scale2 is not None:
            y = y.float() + torch._weight_int8pack_mm(xa, self.codes2, self.scale2[:, 0]).float()
        return y.to(x.dtype)


class Fp8Weight(QuantWeight):
    """float8_e4m3fn codes times group scales (per channel: G = K). CUDA only (Triton; the tests run it on CPU
    under TRITON_INTERPRET=1)."""

    bits: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, device: torch.device | str):
        super().__init__()
        if not _is_cuda(device) and not _interpreted():
            raise ValueError("fp8 weights run on CUDA only (Triton dequant-matmul); use int8 or int4 on CPU")
        n, k = codes.shape
        self.out_features, self.in_features = n, k
        self.register_buffer("bits", codes.to(torch.float8_e4m3fn).view(torch.uint8).contiguous().to(device))
        self.register_buffer("scale", scale.float().contiguous().to(device))

    def dequantize(self) -> torch.Tensor:
        return rtn.dequantize_scaled(self.bits.cpu().view(torch.float8_e4m3fn), self.scale.cpu())

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.quant.triton_mm import FP8, dequant_mm

        return dequant_mm(x.contiguous(), self.bits, self.scale, None, FP8, self.out_features)


def keep_dense_copies(model: nn.Module, min_rows: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Give every CPU-layout quantized weight of `model` (torch's or kernels/quant/cpu_blocks.py's) a copy in `dtype` (the model's) used from `min_rows` rows
    per call on (decode batches of that size and prefill run one dense GEMM; smaller batches the weight-only
    kernels, which read 2-4x fewer bytes). Returns the bytes added. The copy is a buffer, so a compiled forward
    freezes and prepacks it like a dense weight (panels go to their custom op as they are). Copies of the exact dequantized values (bf16 scales, integer
    codes: (q - 8) * s + z computed in `dtype`, as the per-call path does for activations of that dtype).
    float32 copies are for CPUs without native bf16, where torch's bf16 GEMM is many times slower than float32;
    on CPUs with AVX2 and no AVX-512 they are packed in column panels for kernels/cpu/linear.cpp, which runs
    float32 linears about twice as fast as MKL at decode batch sizes there (bench/results/linear_cpu-zen3.md)."""
    panels = dtype == torch.float32 and cpu_ops.panels_preferred()
    if panels:
        cpu_ops.load()
    added = 0
    for m in model.modules():
        if isinstance(m, QuantWeight) and m.takes_dense_copy() and m.dense_copies:  # else the quantized kernel
            m.dense = m.dense_weight(dtype).contiguous()
            if panels and m.out_features % cpu_ops.PANEL == 0:
                m.dense = cpu_ops.pack_panels(m.dense)  # [N / 16, K, 16]: linear_panels beats MKL here
            m.dense_min_rows = min_rows
            added += m.dense.numel() * m.dense.element_size()
    return added


class PanelWeight(nn.Module):
    """A dense float32 weight [N, K] held only as column panels [N / 16, K, 16] (a buffer) for the panel kernel of
    kernels/cpu/linear.cpp: dense float32 models on CPUs where it beats MKL (kernels.cpu.ops.panels_preferred).
    forward(x [..., K]) -> [..., N] in x's dtype, computed in float32."""

    panels: torch.Tensor  # buffer (register_buffer)

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        cpu_ops.load()
        self.out_features, self.in_features = w.shape
        self.register_buffer("panels", cpu_ops.pack_panels(w.detach()))

    def dequantize(self) -> torch.Tensor:
        return cpu_ops.unpack_panels(self.panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = cpu_ops.linear_panels(x.reshape(-1, shape[-1]).float(), self.panels).to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def pack_dense_panels(model: nn.Module, names: tuple[str, ...]) -> int:
    """Replace each dense float32 weight attribute in `names` of `model`'s submodules (frozen Parameters [N, K],
    N % 16 == 0) with a PanelWeight; returns how many. A weight shared with another use (a tied lm_head is also
    the embedding table) gets its own panels and the original stays for that use. Call on CPUs where
    kernels.cpu.ops.panels_preferred()."""
    n = 0
    for m in list(model.modules()):
        for name in names:
            w = m._parameters.get(name)
            if w is None or w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] % cpu_ops.PANEL or w.is_cuda:
                continue
            del m._parameters[name]
            setattr(m, name, PanelWeight(w))
            n += 1
    return n


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _unpack_blocks(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    b = packed.reshape(n // block, k, block // 2)  # [blocks, K, block / 2]
    both = torch.stack([b & 0xF, b >> 4], dim=1)  # [blocks, 2, K, block / 2]: rows i and i + block / 2
    return both.permute(0, 1, 3, 2).reshape(n, k)


@functools.cache
def cpu_int4_block_n() -> int:
    """Output rows per block of torch's CPU int4 layout on this machine: the kernel torch dispatches to packs
    blocks of 4 vectors of floats (64 rows with AVX-512, 32 with AVX2), so the layout depends on the CPU. Found
    once by packing random codes and unpacking them under each candidate."""
    n, k = 128, 8
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block in (64, 32, 16):
        if torch.equal(_unpack_blocks(packed, n, k, block).to(torch.int32), codes):
            return block
    raise RuntimeError("torch's CPU int4 weight layout is none of the known ones (blocks of 64, 32 or 16 rows)")


def unpack_cpu_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of torch._convert_weight_to_int4pack_for_cpu for N % cpu_int4_block_n() == 0: [N, K / 2] ->
    codes [N, K]. Block b of B rows is [K, B / 2] bytes; byte (j, i) holds rows i (low nibble) and i + B / 2."""
    block = cpu_int4_block_n()
    if n % block:
        raise ValueError(f"CPU int4 unpack needs N % {block} == 0, got {n}")
    return _unpack_blocks(packed, n, k, block)


def linear(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) for a dense weight [N, K] or any QuantWeight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    y = w(x)
    return y if bias is None else y + bias


def weight_nbytes(w: torch.Tensor | nn.Module) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(b.numel() * b.element_size() for b in w.buffers())
