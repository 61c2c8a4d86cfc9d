"""CPU block layouts for kernels/cpu/quant_gemv.cpp's weight-only linears, and the choice between them and torch's.

  Q4BlockWeight  qs uint8 [N, K / 2]: per block of 32 inputs 16 bytes, byte i = code i | code i + 16 << 4 (GGUF
                 Q4_1's own order); dm float16 [N, 2, K / 32]: d then m, value = d * q + m.
  Q8BlockWeight  codes int8 [N, K]; d float16 [N, K / 32]: value = d * q (GGUF Q8_0).

From the logical form of kernels.quant (int4: (q - 8) * scale + zero per group of G): d = scale and m = zero - 8 *
scale, repeated for each block of 32 of a group (G a multiple of 32). A GGUF Q4_0/Q4_1/Q8_0 tensor gets its own
float16 d and m back exactly (its zero was m + 8 d in float32; tests/kernels/test_quant_blocks.py checks the file's
bits); round-to-nearest scales are rounded to float16 (relative 2^-11, far below the codes' own rounding). Calls of
fewer than `dense_min_rows` rows (decode) run the native kernel on activations rounded to int8 per block of 32;
more rows one dense GEMM (QuantWeight._dense_mm), as torch's layouts do.

Which layout CPU weights get is process-wide (`set_cpu_kernel`, from --quantization-kernel): "native" these,
"torch" torch's int4pack/int8pack layouts (kernels/quant/weights.py), "auto" native on x86 CPUs with AVX2, FMA
and F16C and no AVX-512 (measured: bench/results/quant.md) when the extension builds; on AVX-512 CPUs native for
the 4-bit blocks and torch's int8 kernel for the 8-bit ones (bench/results/cpu_kernels-avx512.md); else torch.
"""

from __future__ import annotations

import functools

import torch

from kernels import fallbacks
from kernels.cpu import build as cpu_build
from kernels.cpu import ops as cpu_ops
from kernels.quant.weights import QuantWeight

QK = 32  # inputs per block
KERNELS = ("auto", "native", "torch")
_kernel = "auto"


def set_cpu_kernel(mode: str) -> None:
    """Select the CPU weight-only kernels for weights packed from now on in this process (see the module doc)."""
    global _kernel
    if mode not in KERNELS:
        raise ValueError(f"unknown quantization kernel {mode!r} ({', '.join(KERNELS)})")
    _kernel = mode
    if mode == "native" and not native_available():
        raise RuntimeError("--quantization-kernel native needs kernels/cpu built with AVX2, FMA and F16C (x86); "
                           f"this CPU or toolchain has not: {native_unavailable_reason()}")


@functools.cache
def native_unavailable_reason() -> str:
    """Why the native block kernels cannot run here ("" when they can); builds the extension on first call."""
    missing = {"avx2", "fma", "f16c"} - set(cpu_build.cpu_flags().split())
    if missing:
        return f"CPU flags missing: {', '.join(sorted(missing))}"
    try:
        if not cpu_ops.q_gemv_native():
            return "the extension was built without its AVX2 kernels"
    except Exception as e:  # noqa: BLE001 - no toolchain: the torch kernels run instead (auto)
        return f"kernels/cpu did not build: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return ""


def native_available() -> bool:
    return native_unavailable_reason() == ""


def missing_isa() -> str:
    """The instruction-set flags the native block kernels need and this CPU lacks ("" when it has them all)."""
    return ", ".join(sorted({"avx2", "fma", "f16c"} - set(cpu_build.cpu_flags().split())))


def use_native(k: int, group: int, kind: str = "int4", exact: bool = False) -> bool:
    """Whether a CPU weight of `kind` ("int4" or "int8") with K inputs and scale groups of `group` is packed in
    these block layouts. Auto on AVX-512: the 4-bit blocks only (the AVX-512 q4 GEMV beats torch's int4 at one
    row, 1.40x a layer; the q8 GEMV did not beat torch's int8 there: bench/results/cpu_kernels-avx512.md),
    unless `exact` asks for an 8-bit weight's block scales to be kept (torch's int8 kernel would re-round them)."""
    if _kernel == "torch" or k % QK or group % QK:
        return False
    if _kernel == "auto" and "avx512f" in cpu_build.cpu_flags().split() and kind != "int4" and not exact:
        return False
    if not native_available():
        if not missing_isa():  # the CPU has the ISA: the build or load failed, so torch's kernels run instead
            fallbacks.record("quantization_kernel", f"{native_unavailable_reason()}: torch's int4/int8 kernels")
        return False
    return True


def _per_block(t: torch.Tensor, k: int) -> torch.Tensor:
    """Group parameters [N, K / G] -> one per block of 32 [N, K / 32], float32."""
    return t.float().repeat_interleave(k // QK // t.shape[1], dim=1)


class BlockWeight(QuantWeight):
    """Shared by the block layouts: a dense copy (or a per-call dequantization) from `dense_min_rows` rows on,
    the native kernel (`_native`, float32 in and out) below."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.out_features, self.in_features = n, k
        self.register_buffer("dense", None)
        cpu_ops.load()

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize().to(dtype)

    def takes_dense_copy(self) -> bool:
        return True

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        y = self._dense_mm(x)
        if y is not None:
            return y
        return self._native(x.float().contiguous()).to(x.dtype)


class Q4BlockWeight(BlockWeight):
    """4-bit codes in GGUF Q4_1 blocks (module doc); forward(x [..., K]) -> [..., N] in x's dtype."""

    qs: torch.Tensor  # buffers (register_buffer)
    dm: torch.Tensor

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        n, k = codes.shape
        super().__init__(n, k)
        d = _per_block(scale, k)
        m = _per_block(zero, k) - 8.0 * d
        c = codes.to(torch.uint8).reshape(n, k // QK, 2, 16)
        self.register_buffer("qs", (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous())
        self.register_buffer("dm", torch.stack([d, m], dim=1).half().contiguous())  # [N, 2, K / 32]

    def codes(self) -> torch.Tensor:
        """uint8 codes [N, K] 0..15 (exact)."""
        n, k = self.out_features, self.in_features
        b = self.qs.reshape(n, k // QK, 16)
        return torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(n, k)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        q = self.codes().reshape(n, k // QK, QK).float()
        d, m = self.dm.float().unbind(1)
        return (q * d[..., None] + m[..., None]).reshape(n, k)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.q4_linear(x, self.qs, self.dm)


class Q8BlockWeight(BlockWeight):
    """int8 codes with a float16 scale per block of 32 (GGUF Q8_0); forward as Q4BlockWeight's."""

    codes: torch.Tensor  # buffers (register_buffer)
    d: torch.Tensor

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        n, k = codes.shape
        super().__init__(n, k)
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("d", _per_block(scale, k).half().contiguous())  # [N, K / 32]

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        return (self.codes.reshape(n, k // QK, QK).float() * self.d.float()[..., None]).reshape(n, k)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.q8_linear(x, self.codes, self.d)
