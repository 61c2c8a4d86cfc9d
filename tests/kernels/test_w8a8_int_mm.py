"""The large-row W8A8 op (kernels/cpu/w8a8_int_mm.cpp: native per-token quantization, torch._int_mm, native
epilogue) against the torch twin (kernels/quant/w8a8.py's w8a8_mm), the fused op (w8a8_linear) and float64: the
same codes, scales, exact int32 sums and float32 products, so it gives the twin's bits without float channels and
the fused op's bits with them, on every ISA variant built here and on both weight layouts ([K, N] codes and a
transposed view of [N, K] codes). W8A8Weight's "native" kernel switches op at int_mm_rows rows where that is set
(kernels/quant/w8a8.py): rows give the same bits on either side of the threshold. Bad operands raise naming the
operand."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops
from kernels.quant.w8a8 import W8A8Weight, int_mm_exact, quantize_rows, w8a8_mm
from tests.kernels.w8a8_cases import smoothed_weight

INT_MM_ROWS = 256  # the switch row count the threshold tests set on W8A8Weight

# (N, K): the model's qkv, o, gate_up, down, and sizes off every tile (16 channels, 4-deep k-groups, oneDNN's)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (33, 40), (100, 74), (7, 13)]
ROWS = [1, 7, 64, INT_MM_ROWS - 1, INT_MM_ROWS, INT_MM_ROWS + 3, 1000, 2048]


@pytest.fixture(autouse=True)
def exact_int_mm() -> None:
    """w8a8_int_mm multiplies through oneDNN's int8 GEMM, which is exact only with VNNI or AMX-INT8 (elsewhere
    radixgen never calls it: kernels/quant/w8a8.py int_mm_exact, tests/kernels/test_w8a8.py's AVX2 case)."""
    if not int_mm_exact():
        pytest.skip("oneDNN's int8 GEMM saturates on this CPU (no VNNI or AMX-INT8): w8a8_int_mm is not used here")


pytestmark = pytest.mark.usefixtures("native_kernels")


def _weight(n: int, k: int, seed: int, m: int = max(ROWS)) -> tuple[W8A8Weight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    w8 = W8A8Weight(w, None, 1)
    w8.set_kernel("torch")
    return w8, x


@pytest.mark.parametrize("n,k", SHAPES)
def test_gives_the_twins_bits_on_both_layouts(n: int, k: int) -> None:
    w8, x_all = _weight(n, k, seed=n * 5 + k)
    wt_view = w8.wt.t().contiguous().t()  # [K, N] view of [N, K] codes
    for m in ROWS:
        x = x_all[:m]
        twin = w8a8_mm(x, w8.wt, w8.sw)
        if m in (1, INT_MM_ROWS, 2048):
            q, sx = quantize_rows(x)
            ref = (q.double() @ w8.wt.double()) * sx.double() * w8.sw.double()
            assert torch.allclose(twin.double(), ref, rtol=2e-6, atol=1e-30)
        y = ops.w8a8_int_mm(x, w8.wt, w8.sw)
        assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
        assert torch.equal(y, twin), (m, (y - twin).abs().max())
        assert torch.equal(ops.w8a8_int_mm(x, wt_view, w8.sw), twin)
    x = x_all[:33]
    for isa in ops.isas():  # the quantization and epilogue loops are compiled per variant
        ops.cpu_isa(isa)
        assert torch.equal(ops.w8a8_int_mm(x, w8.wt, w8.sw), w8a8_mm(x, w8.wt, w8.sw)), isa
    ops.cpu_isa("auto")


def test_float_channels_give_the_fused_ops_bits_across_the_threshold() -> None:
    """Smoothing plus float channels (fma per channel in order, as the fused op): the two native ops agree bit for
    bit on every variant, within float32 rounding of float64, and W8A8Weight's rows do not change across
    int_mm_rows."""
    w, x = smoothed_weight(23, INT_MM_ROWS + 40)
    assert w.fidx is not None and w.wf is not None and w.inv_s is not None
    w.int_mm_rows = INT_MM_ROWS
    assert w.wp is not None and w.colsum is not None
    for isa in ops.isas():
        ops.cpu_isa(isa)
        fused = ops.w8a8_linear(x, w.wp, w.colsum, w.sw, w.inv_s, w.fidx, w.wf)
        assert torch.equal(ops.w8a8_int_mm(x, w.wt, w.sw, w.inv_s, w.fidx, w.wf), fused), isa
    ops.cpu_isa("auto")
    q, sx = quantize_rows(x, w.inv_s)
    expect = (q.double() @ w.wt.double()) * sx.double() * w.sw.double() + x[:, w.fidx].double() @ w.wf.double()
    assert torch.allclose(fused.double(), expect, rtol=1e-5, atol=1e-4)
    big = w(x)  # INT_MM_ROWS + 40 rows: w8a8_int_mm
    for m in (1, INT_MM_ROWS - 1, INT_MM_ROWS, INT_MM_ROWS + 1):
        assert torch.equal(w(x[:m]), big[:m]), m
    assert torch.equal(big, fused)


def test_bfloat16_strided_and_special_rows() -> None:
    w8, x = _weight(576, 1536, seed=5, m=300)
    full = ops.w8a8_int_mm(x, w8.wt, w8.sw)
    assert torch.equal(ops.w8a8_int_mm(x[::2], w8.wt, w8.sw), full[::2])  # a row-strided view, read in place
    yb = ops.w8a8_int_mm(x.bfloat16(), w8.wt, w8.sw)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, w8a8_mm(x.bfloat16(), w8.wt, w8.sw).bfloat16())
    x = x[:4].clone()
    x[0] = 0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    y = ops.w8a8_int_mm(x, w8.wt, w8.sw)
    assert (y[0] == 0).all() and torch.equal(y[1], full[1])
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()  # a non-finite row gives NaN, never stale codes
    assert ops.w8a8_int_mm(x[:0], w8.wt, w8.sw).shape == (0, 576)


def test_bad_operands_raise() -> None:
    w8, x = _weight(33, 40, seed=3, m=8)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        ops.w8a8_int_mm(x.half(), w8.wt, w8.sw)
    with pytest.raises(RuntimeError, match="wt must be int8"):
        ops.w8a8_int_mm(x[:, :36], w8.wt, w8.sw)  # K of x does not match the weight
    with pytest.raises(RuntimeError, match="wt must be int8"):
        ops.w8a8_int_mm(x, w8.wt.float(), w8.sw)
    with pytest.raises(RuntimeError, match="wt must be int8"):
        ops.w8a8_int_mm(x, w8.wt, w8.sw[:32])  # N of sw does not match the weight
    with pytest.raises(RuntimeError, match="inv_s"):
        ops.w8a8_int_mm(x, w8.wt, w8.sw, torch.ones(39))
    with pytest.raises(RuntimeError, match="fidx and wf"):
        ops.w8a8_int_mm(x, w8.wt, w8.sw, None, torch.tensor([1]), None)
    with pytest.raises(RuntimeError, match="fidx entry"):
        ops.w8a8_int_mm(x, w8.wt, w8.sw, None, torch.tensor([40]), torch.zeros(1, 33))
    with pytest.raises(RuntimeError, match="wf must be"):
        ops.w8a8_int_mm(x, w8.wt, w8.sw, None, torch.tensor([1]), torch.zeros(1, 32))


def test_compiled_graph_and_opcheck() -> None:
    """The op has a fake kernel: torch.compile (fullgraph) traces a large W8A8Weight call through it; opcheck agrees
    on schema, fake shapes and dispatch."""
    w = W8A8Weight(torch.randn(48, 64) * 0.05, None, 1)
    w.set_kernel("native")
    w.int_mm_rows = 8
    x = torch.randn(9, 64)
    fn = torch.compile(lambda t: w(t), backend="eager", fullgraph=True)
    assert torch.equal(fn(x), ops.w8a8_int_mm(x, w.wt, w.sw))
    w8, xs = _weight(33, 40, seed=4, m=5)
    fidx, wf = torch.tensor([2, 9]), torch.randn(2, 33)
    op = torch.ops.radixgen.w8a8_int_mm.default
    torch.library.opcheck(op, (xs, w8.wt, w8.sw, torch.rand(40) + 0.5, fidx, wf))
    torch.library.opcheck(op, (xs[:3].bfloat16(), w8.wt, w8.sw, None, None, None))
