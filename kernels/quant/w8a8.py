"""W8A8 int8 linears for CPU calls bound by arithmetic (prefill, extend, mixed steps, batched decode).

  W8A8Weight  wt int8 [K, N] (the weight's codes, transposed for torch._int_mm), sw float32 [N] (one scale per
              output channel: w[n, k] = wt[k, n] * sw[n]); `small`, the weight-only kernel (4-bit or int8 codes,
              kernels/quant/weights.py or cpu_blocks.py) that calls of fewer than `min_rows` rows run.

A call of M >= min_rows rows: x [M, K] (float32 or bfloat16) is quantized per token, symmetric, dynamically:
sx[m] = max_k |x[m, k]| / 127, q = round(x / sx) in -127..127; torch._int_mm(q, wt) accumulates in int32 (oneDNN's
int8 GEMM: AMX-INT8, AVX512-VNNI, AVX-VNNI or AVX2 `vpmaddubsw`, whichever the CPU has, chosen by oneDNN at run
time); y = acc * sx[:, None] * sw[None, :] in float32, cast to x's dtype. Every row's arithmetic depends on that row
only (per-token scales, exact int32 sums), so a row's output is the same whatever else is in the batch as long as
oneDNN's kernel choice for the call does not change its float rounding of the dequantization, which is one product
per element: rows are batch-invariant bit for bit (tests/kernels/test_w8a8.py checks it).

Weights come from float weights or any QTensor (a GGUF's 4-bit or Q8_0 blocks): dequantized to float32, then
rounded to int8 per output channel (`int8_codes`). The 4-bit codes of `small` stay the file's own, so small-batch
decode reads the same bytes as under --quantization gguf.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.quant import rtn
from kernels.quant.weights import QuantWeight

QMAX = 127.0


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (codes int8 [N, K], scale float32 [N]): symmetric per output channel."""
    codes, scale = rtn.quantize_int8(w.float())
    return codes, scale[:, 0].contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8: x [M, K] float -> (q int8 [M, K], sx float32 [M, 1]); x = q * sx up to rounding.
    An all-zero row gets scale 1 (codes 0), never a division by zero."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.round(xf / sx).to(torch.int8), sx


def w8a8_mm(x: torch.Tensor, wt: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x [M, K] float; wt int8 [K, N]; sw float32 [N] -> float32 [M, N] = dequant(int8(x) @ wt)."""
    q, sx = quantize_rows(x)
    return torch._int_mm(q, wt) * sx * sw


class W8A8Weight(QuantWeight):
    """int8 weight per output channel run with per-token int8 activations from `min_rows` rows on; fewer rows
    run `small` (or the int8 path too when `small` is None). forward(x [..., K]) -> [..., N] in x's dtype."""

    wt: torch.Tensor  # buffers (register_buffer)
    sw: torch.Tensor

    def __init__(self, w: torch.Tensor, small: QuantWeight | None, min_rows: int) -> None:
        """w: the float weight [N, K] to round (a QTensor's dequantization, or a checkpoint's float weight)."""
        super().__init__()
        if w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"W8A8Weight takes a float weight [N, K], got {tuple(w.shape)} {w.dtype}")
        if min_rows < 1:
            raise ValueError(f"min_rows must be >= 1, got {min_rows}")
        if not torch.isfinite(w).all():
            raise ValueError("W8A8Weight: the weight has non-finite values")
        n, k = w.shape
        if small is not None and (small.out_features, small.in_features) != (n, k):
            raise ValueError(f"small kernel is {small.out_features}x{small.in_features}, weight {n}x{k}")
        self.out_features, self.in_features = n, k
        codes, scale = int8_codes(w)
        self.register_buffer("wt", codes.t().contiguous())  # [K, N]
        self.register_buffer("sw", scale)  # [N]
        self.register_buffer("dense", None)  # never a dense copy: the int8 GEMM is what large calls run
        self.small = small
        self.min_rows = min_rows

    def dequantize(self) -> torch.Tensor:
        """The weight the int8 path multiplies by, float32 [N, K]."""
        return self.wt.t().float() * self.sw[:, None]

    def takes_dense_copy(self) -> bool:
        return False

    def uses_int8(self, rows: int) -> bool:
        return self.small is None or rows >= self.min_rows

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes {self.in_features}")
        if not self.uses_int8(x.shape[0]):
            assert self.small is not None  # uses_int8 is True without a small kernel
            return self.small(x)
        return w8a8_mm(x, self.wt, self.sw).to(x.dtype)


def wrap_linears(model: nn.Module, names: tuple[str, ...], min_rows: int) -> list[W8A8Weight]:
    """Replace each QuantWeight attribute in `names` of `model`'s submodules with a W8A8Weight whose int8 codes
    are rounded from that weight's dequantization and whose small-batch kernel is that weight itself; returns the
    new weights. Dense (float) weights are left alone: --quantization w8a8_int8 quantizes every linear on load."""
    out: list[W8A8Weight] = []
    for m in list(model.modules()):
        for name in names:
            w = m._modules.get(name)
            if isinstance(w, QuantWeight) and not isinstance(w, W8A8Weight):
                w8 = W8A8Weight(w.dequantize(), w, min_rows)
                setattr(m, name, w8)
                out.append(w8)
    return out


def int8_isa() -> str:
    """The int8 dot-product instructions oneDNN's int8 GEMM can use on this CPU, best first: amx_int8,
    avx512_vnni, avx_vnni, avx2 (vpmaddubsw), else "reference" (torch's own loops, slow)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1] for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        flags = set()
    for isa in ("amx_int8", "avx512_vnni", "avx_vnni", "avx2"):
        if isa in flags:
            return isa
    return "reference"


def _kernel_name(w: QuantWeight) -> str:
    bits = {"Int4Weight": "int4", "Q4BlockWeight": "int4", "Int8Weight": "int8", "Q8BlockWeight": "int8"}
    return f"{bits.get(type(w).__name__, type(w).__name__)} weight-only ({type(w).__name__})"


def describe_plan(model: nn.Module, names: tuple[str, ...]) -> str:
    """One line: per linear class of `names`, which arithmetic runs at which rows per call."""
    plans: dict[str, str] = {}
    for m in model.modules():
        for name in names:
            w = m._modules.get(name)
            if isinstance(w, W8A8Weight) and name not in plans:
                small = f"rows < {w.min_rows}: {_kernel_name(w.small)}, " if w.small is not None else ""
                plans[name] = f"{name} {small}rows >= {w.min_rows if w.small is not None else 1}: int8 x int8 -> int32"
    isa = int8_isa()
    return (f"int8 arithmetic ({isa} via oneDNN torch._int_mm; activations per token): "
            + "; ".join(plans[n] for n in names if n in plans))
