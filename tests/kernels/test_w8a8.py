"""W8A8 int8 linears (kernels/quant/w8a8.py) against float64 references: the int8 product is exact (int32 sums of
int8 codes), so the kernel must equal float64 arithmetic on the same codes up to the float32 dequantization, and
stay within the quantization error of the float64 product of the unquantized operands. Shapes: the model's K and
N, sizes that are not multiples of any tile, M from 1 to 512; batch invariance; dispatch to the small-batch
kernel; bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from kernels import fallbacks, quant
from kernels.cpu import build as cpu_build
from kernels.quant import w8a8
from kernels.quant.w8a8 import W8A8Weight, describe_plan, int8_codes, quantize_rows, wrap_linears
from runtime.executor import aot_graph

# (N, K): q/o, k/v, up, down of SmolLM2-135M, and sizes off every tile (oneDNN blocks of 16/64, VNNI groups of 4)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (33, 40), (100, 72), (7, 13)]
ROWS = [1, 3, 16, 17, 64, 129, 512]


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4  # rows of different ranges
    w = torch.randn(n, k, generator=g) * 0.05
    return x, w


def _reference(x: torch.Tensor, w: W8A8Weight) -> torch.Tensor:
    """float64 arithmetic on the same int8 codes and scales."""
    q, sx = quantize_rows(x)
    return (q.double() @ w.wt.double()) * sx.double() * w.sw.double()


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_linear_matches_float64_over_shapes(n: int, k: int) -> None:
    x_all, wf = _operands(max(ROWS), n, k, seed=n * 1000 + k)
    w = W8A8Weight(wf, None, 1)
    for m in ROWS:
        x = x_all[:m]
        y = w(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        ref = _reference(x, w)
        # exact int32 sums: only the float32 dequantization (two products) rounds
        assert torch.allclose(y.double(), ref, rtol=2e-6, atol=1e-30), (m, (y.double() - ref).abs().max())
        # against the unquantized float64 product: x = xh + ex, w = wh + ew with |ex| <= sx / 2, |ew| <= sw / 2,
        # so |xh wh^T - x w^T| <= |xh| |ew|^T + |ex| |wh|^T + |ex| |ew|^T, plus the float32 rounding
        q, sx = quantize_rows(x)
        xh, wh = q.double() * sx.double(), w.dequantize().double()
        ex, ew = sx.double() / 2, w.sw.double()[None, :] / 2  # [M, 1], [1, N]
        bound = xh.abs().sum(1, keepdim=True) * ew + ex * wh.abs().sum(1)[None, :] + ex * ew * k
        err = (y.double() - x.double() @ wf.double().t()).abs()
        assert (err <= bound * (1 + 1e-5) + 1e-6).all(), m


def test_lm_head_shape_and_bfloat16_activations() -> None:
    x, wf = _operands(16, 49152, 576, seed=7)
    w = W8A8Weight(wf, None, 1)
    y = w(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (16, 49152)
    ref = _reference(x.bfloat16().float(), w)
    assert torch.allclose(y.double(), ref, rtol=2**-7, atol=1e-6)


def test_rows_are_batch_invariant() -> None:
    """A row's output is the same bits alone, in a batch of 17 and in a batch of 512 (per-token scales, exact
    int32 sums, an elementwise dequantization)."""
    x, wf = _operands(512, 576, 1536, seed=3)
    w = W8A8Weight(wf, None, 1)
    full = w(x)
    for m in (1, 17):
        assert torch.equal(w(x[:m]), full[:m])
    assert torch.equal(w(x[200:201]), full[200:201])


def test_small_calls_run_the_small_kernel() -> None:
    x, wf = _operands(32, 64, 96, seed=5)
    small = quant.to_kernel(quant.quantize(wf, "int8", 0), "cpu")
    w = W8A8Weight(small.dequantize(), small, min_rows=16)
    assert not w.uses_int8(15) and w.uses_int8(16)
    assert torch.equal(w(x[:15]), small(x[:15]))
    assert torch.allclose(w(x[:16]).double(), _reference(x[:16], w), rtol=2e-6, atol=1e-30)
    y3 = w(x[:4].reshape(2, 2, 96))  # leading dims are flattened and restored
    assert y3.shape == (2, 2, 64)


def test_quantize_rows_and_codes() -> None:
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [1e-30, 0.0, -1e-30]])
    q, sx = quantize_rows(x)
    assert q[0].tolist() == [0, 0, 0] and sx[0].item() == 1.0  # an all-zero row: codes 0, no division by zero
    assert q[1].tolist() == [64, -127, 32] and sx[1].item() == pytest.approx(2 / 127)
    assert q.abs().max() <= 127
    codes, scale = int8_codes(torch.tensor([[0.0, 0.0], [3.0, -1.5]]))
    assert codes.tolist() == [[0, 0], [127, -64]] and scale.tolist() == [1.0, pytest.approx(3 / 127)]


def test_smoothing_keeps_the_product_and_calibrates_on_observed_inputs() -> None:
    """An input channel 50x larger than the rest: observe() records it, smooth() moves it into the weight, and
    the int8 product gets closer to the float one than without smoothing; dequantize() undoes the factors."""
    x, wf = _operands(64, 96, 128, seed=11)
    x[:, 5] *= 50
    plain = W8A8Weight(wf, None, 1)
    w = W8A8Weight(wf, None, 1)
    with pytest.raises(RuntimeError, match="observe"):
        w.smooth(wf, 0.5)
    w.observe(True)
    y_obs = w(x[:32])  # observing runs the float product on the current codes
    w.observe(False)
    assert torch.allclose(y_obs, x[:32] @ plain.dequantize().t(), rtol=1e-5, atol=1e-4)
    assert w.amax is not None and w.amax.argmax().item() == 5
    w.smooth(wf, 0.5)
    assert w.inv_s is not None
    assert (w.dequantize() - wf).abs().max() <= (w.sw[:, None] / 2 * w.inv_s[None, :]).max() + 1e-6
    ref = x.double() @ wf.double().t()
    err_s, err_p = (w(x).double() - ref).abs().mean(), (plain(x).double() - ref).abs().mean()
    assert err_s < 0.5 * err_p, (err_s, err_p)
    q, sx = quantize_rows(x, w.inv_s)
    assert torch.allclose(w(x).double(), (q.double() @ w.wt.double()) * sx.double() * w.sw.double(), rtol=2e-6)
    with pytest.raises(ValueError, match="alpha"):
        w.smooth(wf, 1.5)


def test_float_channels_take_the_outliers_out_of_the_int8_path() -> None:
    """Two input channels 50x larger than the rest: smooth(float_channels=2) picks exactly those, runs them in float
    (the output is the float64 product of their columns plus the int8 product of the rest, with those quantized as
    zeros), gets closer to the float product than smoothing alone, and dequantize() is exact on those columns."""
    x, wf = _operands(64, 96, 128, seed=12)
    x[:, [5, 70]] *= 50
    w, only_smoothed = W8A8Weight(wf, None, 1), W8A8Weight(wf, None, 1)
    for v in (w, only_smoothed):
        v.observe(True)
        v(x[:32])
        v.observe(False)
    only_smoothed.smooth(wf, 0.5)
    w.smooth(wf, 0.5, float_channels=2)
    assert w.fidx is not None and w.wf is not None and w.inv_s is not None
    assert w.fidx.tolist() == [5, 70] and (w.inv_s[w.fidx] == 0).all() and (w.wt[w.fidx] == 0).all()
    assert torch.equal(w.dequantize()[:, w.fidx], wf[:, [5, 70]])
    q, sx = quantize_rows(x, w.inv_s)
    assert (q[:, w.fidx] == 0).all()
    expect = (q.double() @ w.wt.double()) * sx.double() * w.sw.double() + x[:, [5, 70]].double() @ w.wf.double()
    assert torch.allclose(w(x).double(), expect, rtol=1e-5, atol=1e-4)
    ref = x.double() @ wf.double().t()
    err_f, err_s = (w(x).double() - ref).abs().mean(), (only_smoothed(x).double() - ref).abs().mean()
    assert err_f < err_s, (err_f, err_s)
    a, b = w(x), torch.cat([w(x[:7]), w(x[7:])])  # float channels keep rows batch-invariant
    assert torch.equal(a, b)
    w.smooth(wf, 0.0, float_channels=0)  # back to plain rounding: no float part left
    assert w.fidx is None and w.wf is None and w.inv_s is None
    with pytest.raises(ValueError, match="float_channels"):
        w.smooth(wf, 0.5, float_channels=128)


def test_bad_inputs_are_refused() -> None:
    wf = torch.randn(8, 16)
    with pytest.raises(ValueError, match="float weight"):
        W8A8Weight(wf.to(torch.int8), None, 1)
    with pytest.raises(ValueError, match="min_rows"):
        W8A8Weight(wf, None, 0)
    with pytest.raises(ValueError, match="non-finite"):
        W8A8Weight(torch.full((2, 2), float("nan")), None, 1)
    small = quant.to_kernel(quant.quantize(torch.randn(8, 32), "int8", 0), "cpu")
    with pytest.raises(ValueError, match="small kernel is 8x32"):
        W8A8Weight(wf, small, 4)
    w = W8A8Weight(wf, None, 1)
    with pytest.raises(ValueError, match="input has 15 features"):
        w(torch.randn(4, 15))


def test_wrap_linears_replaces_quantized_weights_only() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_o = quant.to_kernel(quant.quantize(torch.randn(64, 64), "int4", 32), "cpu")
            self.w_down = nn.Parameter(torch.randn(64, 64), requires_grad=False)  # dense: left alone

    model = nn.Sequential(Layer(), Layer())
    before = model[0].w_o
    wrapped = wrap_linears(model, ("w_o", "w_down"), 8)
    assert len(wrapped) == 2 and isinstance(model[0].w_o, W8A8Weight) and model[0].w_o.small is before
    assert isinstance(model[0].w_down, nn.Parameter)
    # the int8 codes round the 4-bit weight's own values: within half an int8 step per channel
    err = (model[0].w_o.dequantize() - before.dequantize()).abs()
    assert (err <= model[0].w_o.sw[:, None] / 2 + 1e-7).all()
    assert wrap_linears(model, ("w_o",), 8) == []  # idempotent
    if model[0].w_o.kernel == "native":
        model[0].w_o.int_mm_rows = None  # the fused op at every row count (what AVX-512 VNNI CPUs run)
    line = describe_plan(model, ("w_o", "w_down"))
    # the 4-bit kernel is the one `to_kernel` chose on this CPU (the native GEMV where it wins, else torch's)
    small = type(before).__name__
    how = "fused w8a8_linear" if model[0].w_o.kernel == "native" else "torch ops"
    assert f"w_o rows < 8: int4 weight-only ({small}), rows >= 8: int8 x int8 -> int32 ({how})" in line
    if model[0].w_o.kernel == "native":  # a weight that switches to oneDNN's core says from which row count
        model[0].w_o.int_mm_rows = 300
        assert (f"w_o rows < 8: int4 weight-only ({small}), rows 8..299: int8 x int8 -> int32 (fused w8a8_linear), "
                "rows >= 300: the same on oneDNN's core (w8a8_int_mm)") in describe_plan(model, ("w_o",))
        # compiled graphs are cut at every row count where a linear changes path
        assert {8, 300} <= aot_graph.row_thresholds(model)


@pytest.mark.parametrize("exact", [True, False])
def test_int8_mm_is_exact_on_both_paths(exact: bool) -> None:
    """The torch twin's int8 product: torch._int_mm where oneDNN is exact, float32 chunks of EXACT_K elsewhere;
    full-range codes, the extremes that saturate int16 pair sums, K past one and two chunks."""
    if exact and not w8a8.int_mm_exact():
        pytest.skip("oneDNN's int8 GEMM saturates on this CPU (no VNNI or AMX-INT8)")
    g = torch.Generator().manual_seed(11)
    for m, k, n in ((1, 576, 960), (64, 1536, 576), (5, 2 * w8a8.EXACT_K + 3, 17)):
        q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
        wt = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8)
        assert torch.equal(w8a8.int8_mm(q, wt, exact).long(), q.long() @ wt.long()), (m, k, n)
        for a, b in ((127, 127), (-127, 127), (127, -127)):
            qa, wb = torch.full_like(q, a), torch.full_like(wt, b)
            out = w8a8.int8_mm(qa, wb, exact)
            assert out.dtype == torch.int32 and (out.long() == a * b * k).all(), (a, b, k)


# oneDNN held to AVX2 (its int8 GEMM then saturates) and kernels/cpu's AVX2 variant forced: what an AVX2-only CPU runs
AVX2_SCRIPT = textwrap.dedent("""
    import torch
    from kernels.cpu import ops
    ops.load()
    assert "avx2" in ops.isas(), ops.isas()
    ops.cpu_isa("avx2")
    from kernels.quant import w8a8
    q = torch.full((4, 256), 127, dtype=torch.int8)
    assert (torch._int_mm(q, q.t().contiguous()) != 127 * 127 * 256).all()  # oneDNN's saturation, as documented
    assert not w8a8.int_mm_exact() and w8a8.default_int_mm_rows() is None and not w8a8.native_unavailable_reason()
    g = torch.Generator().manual_seed(3)
    w = w8a8.W8A8Weight(torch.randn(576, 1536, generator=g) * 0.05, None, 1)
    assert w.kernel == "native" and w.int_mm_rows is None
    x = torch.randn(129, 1536, generator=g) * 4
    y = w(x)
    q, sx = w8a8.quantize_rows(x)
    ref = (q.double() @ w.wt.double()) * sx.double() * w.sw.double()
    assert torch.allclose(y.double(), ref, rtol=2e-6, atol=1e-30), (y.double() - ref).abs().max()
    w.set_kernel("torch")
    assert torch.equal(w(x), y)
    try:
        w.set_kernel("int_mm")
        raise AssertionError("int_mm accepted where oneDNN saturates")
    except RuntimeError as e:
        assert "saturates" in str(e)
    print("ok")
""")


@pytest.mark.usefixtures("native_kernels")
def test_avx2_cpus_run_the_exact_native_tile() -> None:
    """Where oneDNN's int8 GEMM lacks VNNI (emulated here by ONEDNN_MAX_CPU_ISA=AVX2 and the forced AVX2 variant),
    W8A8 calls run kernels/cpu's exact vpmaddubsw tile at every row count and the torch twin its exact float32
    chunks: both give the float64 reference's bits on the same codes."""
    if not {"avx2", "fma", "f16c"} <= set(cpu_build.cpu_flags().split()):
        pytest.skip("this CPU lacks the AVX2 variant's avx2, fma, f16c")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", AVX2_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("flags,exact,rows", [
    ("avx2 fma f16c avx512f avx512_vnni amx_int8", True, w8a8.AMX_INT_MM_ROWS),
    ("avx2 fma f16c avx512f avx512_vnni", True, None),
    ("avx2 fma f16c avx_vnni", True, w8a8.AVX2_INT_MM_ROWS),
    ("avx2 fma f16c", False, None),
    ("avx2 fma f16c avx512f", False, None),
])
def test_the_op_switch_follows_the_cpus_int8_arithmetic(flags: str, exact: bool, rows: int | None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(w8a8, "int_mm_exact", lambda: exact)
    assert w8a8.default_int_mm_rows() == rows
    assert w8a8.int8_isa() == next(f for f in ("amx_int8", "avx512_vnni", "avx_vnni", "avx2") if f in flags.split())


@pytest.mark.parametrize("exact", [True, False])
def test_the_torch_twin_compiles_as_one_graph(exact: bool) -> None:
    """The torch kernel (the path without a toolchain) traces whole on either int8 product: the probe of oneDNN
    runs when the weight is built, never inside the trace."""
    if exact and not w8a8.int_mm_exact():
        pytest.skip("oneDNN's int8 GEMM saturates on this CPU (no VNNI or AMX-INT8)")
    x, wf = _operands(16, 48, 1100, seed=5)  # K past one float32 chunk
    w = W8A8Weight(wf, None, 1)
    w.set_kernel("torch")
    w.int_mm_exact = exact
    torch._dynamo.reset()
    y = torch.compile(w, fullgraph=True, dynamic=True)(x)
    assert torch.allclose(y.double(), _reference(x, w), rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("exact", [True, False])
def test_the_torch_path_is_a_recorded_fallback(exact: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where kernels/cpu cannot run the int8 tile, every W8A8Weight runs the torch ops, and that is said once
    (log line and /get_server_info's fallbacks), naming which int8 product runs."""
    monkeypatch.setattr(w8a8, "native_unavailable_reason", lambda: "kernels/cpu did not build: no compiler")
    monkeypatch.setattr(w8a8, "int_mm_exact", lambda: exact)
    monkeypatch.setattr(fallbacks, "_recorded", {})
    x, wf = _operands(4, 16, 32, seed=1)
    w = W8A8Weight(wf, None, 1)
    assert w.kernel == "torch" and w.int_mm_exact is exact
    said = fallbacks.recorded()["int8_kernel"]
    assert said.startswith("kernels/cpu did not build: no compiler")
    assert ("torch._int_mm" in said) is exact and ("saturates" in said) is not exact
    assert torch.allclose(w(x).double(), _reference(x, w), rtol=2e-6, atol=1e-30)
