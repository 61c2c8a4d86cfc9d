"""W8A8 int8 linears for CPU calls bound by arithmetic (prefill, extend, mixed steps, batched decode).

  W8A8Weight  wt int8 [K, N] (the weight's codes, transposed for torch._int_mm), sw float32 [N] (one scale per
              output channel: w[n, k] = wt[k, n] * sw[n]); `small`, the weight-only kernel (4-bit or int8 codes,
              kernels/quant/weights.py or cpu_blocks.py) that calls of fewer than `min_rows` rows run.

A call of M >= min_rows rows: x [M, K] (float32 or bfloat16) is quantized per token, symmetric, dynamically:
sx[m] = max_k |x[m, k]| / 127, q = round(x / sx) in -127..127; acc = q @ wt exact in int32 (`int8_mm`: oneDNN's
int8 GEMM through torch._int_mm where the CPU has VNNI or AMX-INT8, float32 products of the codes in exact chunks
elsewhere); y = acc * sx[:, None] * sw[None, :] in float32, cast to x's dtype. Every row's arithmetic depends on
that row only (per-token scales, exact int32 sums), so a row's output is the same whatever else is in the batch as
long as oneDNN's kernel choice for the call does not change its float rounding of the dequantization, which is one
product per element: rows are batch-invariant bit for bit (tests/kernels/test_w8a8.py checks it).

Smoothing (SmoothQuant's migration, optional per weight): activations of some input channels run far larger than
the rest, so one scale per token leaves the others few levels. With per-channel factors s [K] the product is
unchanged, x @ W^T = (x / s) @ (W * s)^T: the int8 codes are rounded from W * s and calls quantize x * inv_s, one
multiply fused into the quantization pass. s_k = amax_k^alpha / wmax_k^(1 - alpha), amax_k the largest |x[:, k]| seen
on calibration text (`observe`), wmax_k the largest |W[:, k]|.

Float channels (LLM.int8()'s decomposition, optional per weight, after smoothing): the `k` input channels whose
smoothed calibration |x| is largest skip the int8 path: their entries of inv_s are 0 (so they quantize to 0 and
leave the token's scale to the other channels) and their weight rows run in float, y += x[:, fidx] @ wf with
wf float32 [k, N]. The int8 codes are rounded without those columns.

Kernel: where kernels/cpu builds a vector int8 tile ("native": vpdpbusd on AVX-512 VNNI, else an exact vpmaddubsw
tile on AVX2), a call of int8 rows is one fused native op (kernels/cpu/w8a8_linear.cpp: quantization, the int8
product on codes packed at load, `wp` and `colsum`, the dequantization and the float channels in one pass).
kernels/cpu/w8a8_int_mm.cpp runs the same quantization and epilogue as native passes around torch._int_mm on `wt`
(oneDNN's int8 GEMM core); the two ops give the same bits (float channels included), so a weight may switch op at
`int_mm_rows` rows without changing any row's output. With AVX-512 VNNI the fused op is as fast or faster at every
row count once the float channels are counted (bench/results/int8_linear.md), so "native" switches only where
`default_int_mm_rows` says (AMX-INT8; AVX-VNNI without AVX-512), and never where oneDNN's int8 GEMM is not exact
(`int_mm_exact`: without VNNI and AMX its int16 pair sums saturate). Elsewhere (and as the reference,
`set_kernel("torch")`) the torch ops above, whose int8 product is `int8_mm` (exact on every CPU); they give the same
bits without float channels (the native float-channel term is a fused multiply-add per channel, addmm's order
differs by float32 rounding).
`set_kernel("fused"|"int_mm")` pins one native op at every row count (benchmarks).

Weights come from float weights or any QTensor (a GGUF's 4-bit or Q8_0 blocks): dequantized to float32, then
rounded to int8 per output channel (`int8_codes`). The 4-bit codes of `small` stay the file's own, so small-batch
decode reads the same bytes as under --quantization gguf.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kernels import fallbacks
from kernels.cpu import build as cpu_build
from kernels.cpu import ops as cpu_ops
from kernels.quant import rtn
from kernels.quant.weights import QuantWeight

QMAX = 127.0


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (codes int8 [N, K], scale float32 [N]): symmetric per output channel."""
    codes, scale = rtn.quantize_int8(w.float())
    return codes, scale[:, 0].contiguous()


def quantize_rows(x: torch.Tensor, inv_s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8: x [M, K] float (times inv_s [K] when given) -> (q int8 [M, K], sx float32 [M, 1]);
    x * inv_s = q * sx up to rounding. An all-zero row gets scale 1 (codes 0), never a division by zero."""
    xf = x.float() if inv_s is None else x.float() * inv_s
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.round(xf / sx).to(torch.int8), sx


# A float32 sum of this many int8 x int8 products is exact in any order: 127 * 127 * 1024 < 2^24.
EXACT_K = 1024


@functools.cache
def int_mm_exact() -> bool:
    """Whether torch._int_mm is exact on this CPU. oneDNN's int8 GEMM without VNNI or AMX-INT8 (AVX2, AVX-512
    without VNNI, or a lower ONEDNN_MAX_CPU_ISA) multiplies u8 (s8 + 128) by s8 with vpmaddubsw, whose int16 sums
    of two products saturate (255 * 127 * 2 > 32767; oneDNN's int8 guide says so): 127s times 127s over 256 terms
    come out 32640 instead of 4129024. Probed once, at one and at 64 rows, on exactly those codes."""
    w = torch.full((256, 64), 127, dtype=torch.int8)
    return all(bool((torch._int_mm(torch.full((m, 256), 127, dtype=torch.int8), w) == 127 * 127 * 256).all())
               for m in (1, 64))


def int8_mm(q: torch.Tensor, wt: torch.Tensor, exact: bool | None = None) -> torch.Tensor:
    """q int8 [M, K] @ wt int8 [K, N] -> int32 [M, N], exact: torch._int_mm where it is exact (`exact`, else
    int_mm_exact(); a caller inside a compiled graph passes it, so the probe never runs in a trace), else float32
    products over K chunks of EXACT_K, each chunk's sum exact, added in int32."""
    if int_mm_exact() if exact is None else exact:
        return torch._int_mm(q, wt)
    acc = torch.zeros(q.shape[0], wt.shape[1], dtype=torch.int32)
    for k0 in range(0, q.shape[1], EXACT_K):
        acc += (q[:, k0:k0 + EXACT_K].float() @ wt[k0:k0 + EXACT_K].float()).to(torch.int32)
    return acc


def w8a8_mm(x: torch.Tensor, wt: torch.Tensor, sw: torch.Tensor, inv_s: torch.Tensor | None = None,
            exact: bool | None = None) -> torch.Tensor:
    """x [M, K] float; wt int8 [K, N]; sw float32 [N]; inv_s float32 [K] or None -> float32 [M, N] =
    dequant(int8(x * inv_s) @ wt); `exact` as int8_mm's."""
    q, sx = quantize_rows(x, inv_s)
    return int8_mm(q, wt, exact) * sx * sw


@functools.cache
def native_unavailable_reason() -> str:
    """Why W8A8 calls cannot run the native op here ("" when they can); builds kernels/cpu on first call. Native
    runs where kernels/cpu builds a vector int8 tile: vpdpbusd on AVX-512 VNNI, else the exact vpmaddubsw tile on
    AVX2."""
    try:
        if not cpu_ops.w8a8_native():
            return "kernels/cpu was built without its vector w8a8 kernel"
    except Exception as e:  # noqa: BLE001 - no toolchain: the torch twin runs instead
        return f"kernels/cpu did not build: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return ""


KERNELS = ("native", "fused", "int_mm", "torch")
# From how many rows per call the "native" kernel runs w8a8_int_mm (oneDNN's int8 core) instead of the fused
# register-tile op (the same bits either way), by the int8 arithmetic each can use:
# - oneDNN's int8 GEMM saturates (no VNNI or AMX-INT8): never (int_mm_exact).
# - AMX-INT8: from AMX_INT_MM_ROWS, two 16-row AMX tiles, where oneDNN's tile multiplies outrun the fused op's
#   vpdpbusd many times over. Not measured here: no AMX CPU was at hand.
# - AVX-512 VNNI without AMX: never; the fused op measured as fast or faster at 64..2048 rows on every layer shape
#   with the model's float channels (bench/results/int8_linear.md).
# - AVX-VNNI without AVX-512 (the fused tile is AVX2's vpmaddubsw): from AVX2_INT_MM_ROWS; with oneDNN held to AVX2,
#   a core no faster than AVX-VNNI's, w8a8_int_mm won on every layer shape from 256 rows and lost on most at 128
#   (bench/results/int8_linear-avx2.md).
AMX_INT_MM_ROWS = 32
AVX2_INT_MM_ROWS = 256


def default_int_mm_rows() -> int | None:
    """The row count from which "native" runs w8a8_int_mm on this CPU, None for never (the rule above)."""
    flags = set(cpu_build.cpu_flags().split())
    if not int_mm_exact():
        return None
    if "amx_int8" in flags:
        return AMX_INT_MM_ROWS
    return None if "avx512_vnni" in flags else AVX2_INT_MM_ROWS


class W8A8Weight(QuantWeight):
    """int8 weight per output channel run with per-token int8 activations from `min_rows` rows on; fewer rows
    run `small` (or the int8 path too when `small` is None). forward(x [..., K]) -> [..., N] in x's dtype."""

    wt: torch.Tensor  # buffers (register_buffer)
    sw: torch.Tensor
    inv_s: torch.Tensor | None
    fidx: torch.Tensor | None
    wf: torch.Tensor | None
    wp: torch.Tensor | None  # the native op's packed codes and their column sums (kernels.cpu.ops.pack_vnni)
    colsum: torch.Tensor | None

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
        self.kernel = "torch" if native_unavailable_reason() else "native"
        self.int_mm_exact = int_mm_exact()  # probed here, outside any compiled graph
        if self.kernel == "torch":
            fallbacks.record("int8_kernel", f"{native_unavailable_reason()}: W8A8 linears run torch ops around "
                             + ("torch._int_mm" if self.int_mm_exact else "float32 products of the int8 codes "
                                "(oneDNN's int8 GEMM saturates on this CPU)"))
        self.int_mm_rows = default_int_mm_rows()  # "native": w8a8_int_mm from this many rows (None: never)
        self.register_buffer("wt", codes.t().contiguous())  # [K, N]
        self.register_buffer("sw", scale)  # [N]
        self.register_buffer("wp", None)
        self.register_buffer("colsum", None)
        self._pack()
        self.register_buffer("inv_s", None)  # [K] after smooth()
        self.register_buffer("fidx", None)  # int64 [k]: input channels run in float (smooth(float_channels=k))
        self.register_buffer("wf", None)  # float32 [k, N]: their weight rows
        self.register_buffer("dense", None)  # never a dense copy: the int8 GEMM is what large calls run
        self.small = small
        self.min_rows = min_rows
        self.observing = False
        self.amax: torch.Tensor | None = None  # [K] while observing: the largest |x| per input channel seen

    def _pack(self) -> None:
        """(Re)pack wt for the fused op; the torch and int_mm kernels keep no packed copy."""
        packed = self.kernel in ("native", "fused")
        self.wp, self.colsum = cpu_ops.pack_vnni(self.wt) if packed else (None, None)

    def set_kernel(self, kernel: str) -> None:
        """"native" (kernels/cpu: the fused op, or w8a8_int_mm from int_mm_rows rows where that is set), "fused" or
        "int_mm" (that native op at every row count), or "torch" (the torch ops, the reference); a native kernel
        raises where it cannot run."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown w8a8 kernel {kernel!r} ({', '.join(KERNELS)})")
        if kernel != "torch" and native_unavailable_reason():
            raise RuntimeError(f"the native w8a8 kernel cannot run here: {native_unavailable_reason()}")
        if kernel == "int_mm" and not self.int_mm_exact:
            raise RuntimeError("w8a8_int_mm cannot run here: oneDNN's int8 GEMM saturates on this CPU")
        self.kernel = kernel
        self._pack()

    def observe(self, on: bool) -> None:
        """While on, every call records max |x| per input channel and runs the exact path (`small`, else a float
        product on the current codes); off leaves the record for smooth()."""
        self.amax = torch.zeros(self.in_features) if on else self.amax
        self.observing = on

    def smooth(self, w: torch.Tensor, alpha: float, float_channels: int = 0) -> None:
        """Re-round the int8 codes from the float weight w [N, K] with smoothing factors from the recorded amax
        (module doc); alpha 0 is plain per-channel rounding. float_channels > 0: that many input channels, those of
        the largest smoothed amax, run in float instead (module doc)."""
        if self.amax is None:
            raise RuntimeError("smooth() needs observe(True), calls, then observe(False)")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"smoothing alpha must be in [0, 1], got {alpha}")
        if not 0 <= float_channels < self.in_features:
            raise ValueError(f"float_channels must be in [0, {self.in_features}), got {float_channels}")
        w = w.float()
        a, b = self.amax.clamp_min(1e-5), w.abs().amax(0).clamp_min(1e-5)
        s = (a**alpha / b ** (1 - alpha)).clamp(1e-3, 1e3) if alpha > 0 else torch.ones_like(a)
        inv_s = 1.0 / s
        self.fidx = self.wf = None
        if float_channels:
            fidx = torch.topk(a * inv_s, float_channels).indices.sort().values
            inv_s[fidx] = 0.0
            self.fidx, self.wf = fidx, w[:, fidx].t().contiguous()
        codes, scale = int8_codes(w * s * (inv_s > 0))
        self.wt, self.sw = codes.t().contiguous(), scale
        self._pack()
        self.inv_s = None if alpha == 0 and not float_channels else inv_s.contiguous()

    def dequantize(self) -> torch.Tensor:
        """The weight the int8 path multiplies by, float32 [N, K] (smoothing undone)."""
        w = self.wt.t().float() * self.sw[:, None]
        w = w if self.inv_s is None else w * self.inv_s
        if self.fidx is not None and self.wf is not None:
            w[:, self.fidx] = self.wf.t()
        return w

    def takes_dense_copy(self) -> bool:
        return False

    def uses_int8(self, rows: int) -> bool:
        return self.small is None or rows >= self.min_rows

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes {self.in_features}")
        if self.observing:
            assert self.amax is not None  # set by observe(True)
            self.amax = torch.maximum(self.amax, x.detach().float().abs().amax(0))
            return self.small(x) if self.small is not None else (x.float() @ self.dequantize().t()).to(x.dtype)
        if not self.uses_int8(x.shape[0]):
            assert self.small is not None  # uses_int8 is True without a small kernel
            return self.small(x)
        if self.kernel != "torch" and x.dtype in (torch.float32, torch.bfloat16):
            big = self.int_mm_rows is not None and x.shape[0] >= self.int_mm_rows
            if self.kernel == "int_mm" or (self.kernel == "native" and big):
                return cpu_ops.w8a8_int_mm(x, self.wt, self.sw, self.inv_s, self.fidx, self.wf)
            assert self.wp is not None and self.colsum is not None  # packed while the kernel is native or fused
            return cpu_ops.w8a8_linear(x, self.wp, self.colsum, self.sw, self.inv_s, self.fidx, self.wf)
        y = w8a8_mm(x, self.wt, self.sw, self.inv_s, self.int_mm_exact)
        if self.fidx is not None and self.wf is not None:
            y = torch.addmm(y, x[:, self.fidx].float(), self.wf)
        return y.to(x.dtype)


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
    flags = set(cpu_build.cpu_flags().split())
    return next((isa for isa in ("amx_int8", "avx512_vnni", "avx_vnni", "avx2") if isa in flags), "reference")


def _kernel_name(w: QuantWeight) -> str:
    bits = {"Int4Weight": "int4", "Q4BlockWeight": "int4", "Int8Weight": "int8", "Q8BlockWeight": "int8"}
    return f"{bits.get(type(w).__name__, type(w).__name__)} weight-only ({type(w).__name__})"


def describe_plan(model: nn.Module, names: tuple[str, ...]) -> str:
    """One line: per linear class of `names`, which kernel runs at which rows per call."""
    plans: dict[str, str] = {}
    for m in model.modules():
        for name in names:
            w = m._modules.get(name)
            if isinstance(w, W8A8Weight) and name not in plans:
                small = f"rows < {w.min_rows}: {_kernel_name(w.small)}, " if w.small is not None else ""
                extra = f" + {w.fidx.numel()} float input channels" if w.fidx is not None else ""
                lo = w.min_rows if w.small is not None else 1
                if w.kernel == "native" and w.int_mm_rows is not None and w.int_mm_rows > lo:
                    big = (f"rows {lo}..{w.int_mm_rows - 1}: int8 x int8 -> int32{extra} (fused w8a8_linear), "
                           f"rows >= {w.int_mm_rows}: the same on oneDNN's core (w8a8_int_mm)")
                else:
                    native = "fused w8a8_linear" if w.int_mm_rows is None else "w8a8_int_mm"
                    how = {"native": native, "int_mm": "w8a8_int_mm", "fused": "fused w8a8_linear",
                           "torch": "torch ops"}[w.kernel]
                    big = f"rows >= {lo}: int8 x int8 -> int32{extra} ({how})"
                plans[name] = f"{name} {small}{big}"
    isa = int8_isa()
    how = ("kernels/cpu" if not native_unavailable_reason() else "oneDNN torch._int_mm" if int_mm_exact()
           else "float32 products of the codes: oneDNN's int8 GEMM saturates here")
    return (f"int8 arithmetic ({isa} via {how}; activations per token): "
            + "; ".join(plans[n] for n in names if n in plans))
