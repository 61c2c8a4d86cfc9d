"""The fused native W8A8 linear (kernels/cpu/w8a8_linear.cpp) against its torch twin (kernels/quant/w8a8.py's
w8a8_mm: torch._int_mm, or exact float32 chunks where oneDNN saturates) and float64: the same codes and scales,
exact int32 sums and the same two float32 products, so without float channels every ISA variant built here gives
the twin's bits; with smoothing and float channels it stays within float32 rounding of the float64 sum. Rows are
batch-invariant bit for bit. Bad operands raise naming the operand."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops
from kernels.quant.w8a8 import W8A8Weight, quantize_rows, w8a8_mm
from tests.kernels.w8a8_cases import smoothed_weight

# (N, K): the model's qkv, o, gate_up, down, and sizes off the 16-channel tile and the 4-deep k-group
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (33, 40), (100, 74), (7, 13)]
ROWS = [1, 2, 7, 32, 33, 64, 512]


pytestmark = pytest.mark.usefixtures("native_kernels")


def _weight(n: int, k: int, seed: int) -> tuple[W8A8Weight, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(max(ROWS), k, generator=g) * torch.rand(max(ROWS), 1, generator=g) * 4
    w8 = W8A8Weight(w, None, 1)
    w8.set_kernel("torch")
    wp, colsum = ops.pack_vnni(w8.wt)
    return w8, x, wp, colsum


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_variant_gives_the_twins_bits(n: int, k: int) -> None:
    w8, x_all, wp, colsum = _weight(n, k, seed=n * 7 + k)
    for m in ROWS:
        x = x_all[:m]
        twin = w8a8_mm(x, w8.wt, w8.sw)
        q, sx = quantize_rows(x)
        ref = (q.double() @ w8.wt.double()) * sx.double() * w8.sw.double()
        assert torch.allclose(twin.double(), ref, rtol=2e-6, atol=1e-30)
        for isa in ops.isas():
            ops.cpu_isa(isa)
            y = ops.w8a8_linear(x, wp, colsum, w8.sw)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert torch.equal(y, twin), (isa, m, (y - twin).abs().max())
    ops.cpu_isa("auto")


def test_smoothing_and_float_channels_match_float64() -> None:
    """Two outlier channels run in float (fma per channel), the rest smoothed int8: within float32 rounding of the
    float64 sum of the same codes, the same on every variant, and the twin within float32 rounding of it."""
    w, x = smoothed_weight(21, 33)
    assert w.fidx is not None and w.wf is not None and w.inv_s is not None
    q, sx = quantize_rows(x, w.inv_s)
    expect = (q.double() @ w.wt.double()) * sx.double() * w.sw.double() + x[:, w.fidx].double() @ w.wf.double()
    ys = []
    for isa in ops.isas():
        ops.cpu_isa(isa)
        ys.append(w(x))
    ops.cpu_isa("auto")
    assert all(torch.equal(y, ys[0]) for y in ys)
    assert torch.allclose(ys[0].double(), expect, rtol=1e-5, atol=1e-4)
    w.set_kernel("torch")
    assert torch.allclose(w(x), ys[0], rtol=1e-5, atol=1e-4)


def test_rows_are_batch_invariant_and_bfloat16_rounds_once() -> None:
    w8, x, wp, colsum = _weight(576, 1536, seed=5)
    full = ops.w8a8_linear(x, wp, colsum, w8.sw)
    for lo, hi in ((0, 1), (0, 17), (200, 201), (500, 512)):
        assert torch.equal(ops.w8a8_linear(x[lo:hi], wp, colsum, w8.sw), full[lo:hi])
    # a row-strided view (every other row) is read in place
    assert torch.equal(ops.w8a8_linear(x[::2], wp, colsum, w8.sw), full[::2])
    twin = w8a8_mm(x.bfloat16(), w8.wt, w8.sw).bfloat16()
    for isa in ops.isas():  # each variant widens bf16 activations in its own quantization pass
        ops.cpu_isa(isa)
        yb = ops.w8a8_linear(x.bfloat16(), wp, colsum, w8.sw)
        assert yb.dtype == torch.bfloat16
        assert torch.equal(yb, twin), isa
    ops.cpu_isa("auto")


@pytest.mark.parametrize("k", [40, 43])
def test_zero_and_non_finite_rows(k: int) -> None:
    w8, x, wp, colsum = _weight(33, k, seed=9)
    x = x[:6].clone()
    x[0] = 0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    x[4, k - 1] = float("-inf")  # in the vector passes' tail where K is not a multiple of their width
    x[5, k - 2] = float("nan")
    for isa in ops.isas():
        ops.cpu_isa(isa)
        y = ops.w8a8_linear(x, wp, colsum, w8.sw)
        assert (y[0] == 0).all() and torch.isfinite(y[1]).all(), isa
        assert torch.isnan(y[2:]).all(), isa  # a non-finite row gives NaN, never stale codes
        assert torch.equal(y[1], w8a8_mm(x[1:2], w8.wt, w8.sw)[0]), isa
    ops.cpu_isa("auto")


def test_bad_operands_raise() -> None:
    w8, x, wp, colsum = _weight(33, 40, seed=3)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        ops.w8a8_linear(x.half(), wp, colsum, w8.sw)
    with pytest.raises(RuntimeError, match="wp must be"):
        ops.w8a8_linear(x[:, :36], wp, colsum, w8.sw)  # K of x does not match the packed weight
    with pytest.raises(RuntimeError, match="wp must be"):
        ops.w8a8_linear(x, wp.float(), colsum, w8.sw)
    with pytest.raises(RuntimeError, match="colsum"):
        ops.w8a8_linear(x, wp, colsum[:16], w8.sw)
    with pytest.raises(RuntimeError, match="inv_s"):
        ops.w8a8_linear(x, wp, colsum, w8.sw, torch.ones(39))
    with pytest.raises(RuntimeError, match="fidx and wf"):
        ops.w8a8_linear(x, wp, colsum, w8.sw, None, torch.tensor([1]), None)
    with pytest.raises(RuntimeError, match="fidx entry"):
        ops.w8a8_linear(x, wp, colsum, w8.sw, None, torch.tensor([40]), torch.zeros(1, 33))
    with pytest.raises(RuntimeError, match="wf must be"):
        ops.w8a8_linear(x, wp, colsum, w8.sw, None, torch.tensor([1]), torch.zeros(1, 32))
    with pytest.raises(ValueError, match="int8 codes"):
        ops.pack_vnni(w8.wt.float())
    with pytest.raises(ValueError, match="unknown w8a8 kernel"):
        w8.set_kernel("onednn")


def test_compiled_graph_calls_the_op() -> None:
    """The op has a fake kernel: torch.compile traces a W8A8Weight call and runs the native op inside the graph."""
    w = W8A8Weight(torch.randn(48, 64) * 0.05, None, 1)
    w.set_kernel("native")
    x = torch.randn(8, 64)
    fn = torch.compile(lambda t: w(t), backend="eager", fullgraph=True)
    assert torch.equal(fn(x), w(x))


def test_opcheck_schema_and_fake() -> None:
    """torch.library.opcheck: the schema, the fake kernel's shapes and dtypes, and the op's dispatch agree."""
    w8, x, wp, colsum = _weight(33, 40, seed=4)
    fidx, wf = torch.tensor([2, 9]), torch.randn(2, 33)
    torch.library.opcheck(torch.ops.radixgen.w8a8_linear.default,
                          (x[:5], wp, colsum, w8.sw, torch.rand(40) + 0.5, fidx, wf))
    torch.library.opcheck(torch.ops.radixgen.w8a8_linear.default, (x[:3].bfloat16(), wp, colsum, w8.sw, None, None, None))
