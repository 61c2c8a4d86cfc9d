"""The native CPU row ops (kernels/cpu/elementwise.cpp) against kernels/ref.py over a grid of shapes, and the
eager SmolLM2 forward with them against the reference ops.

Tolerances: float32 within 1e-5 (float32 sums in another order, a different exp); bfloat16 within one bf16 ulp
of the reference (both round a float32 result once, except ref's silu_mul, which rounds twice)."""

from __future__ import annotations

import pytest
import torch

from kernels import ref
from kernels.cpu import ops

ops.load()
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h", [(1, 576), (7, 64), (33, 576), (200, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_ref(dtype, t, h, with_residual):
    g = torch.Generator().manual_seed(t * h)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    res = torch.randn(t, h, generator=g).to(dtype) if with_residual else None
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    out, hsum = ops.rmsnorm(x, w, 1e-5, res)
    want, want_h = ref.rmsnorm(x, w, 1e-5, res)
    assert out.dtype == dtype and out.shape == (t, h)
    torch.testing.assert_close(out, want, **TOL[dtype])
    assert torch.equal(hsum, want_h)  # the residual sum rounds exactly as torch's add
    if not with_residual:
        assert hsum is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (5, 4, 4, 32), (70, 9, 3, 64), (16, 8, 2, 128)])
def test_rope_matches_ref_on_a_fused_qkv_view(dtype, t, hq, hkv, d):
    """q and k are views into one [T, (Hq + 2 Hkv) D] projection, as in the model (strided rows)."""
    g = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 4000, (t,), generator=g)
    cos_sin = ref.rope_cos_sin(d, 4096, 10000.0)
    (gq, gk), (wq, wk) = ops.apply_rope(q, k, pos, cos_sin), ref.apply_rope(q, k, pos, cos_sin)
    torch.testing.assert_close(gq, wq, **TOL[dtype])
    torch.testing.assert_close(gk, wk, **TOL[dtype])
    with pytest.raises(RuntimeError, match="out of the cos/sin table"):
        ops.rope(q, cos_sin, torch.full((t,), 4096))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,i", [(1, 1536), (9, 100), (64, 1536)])
def test_silu_mul_matches_ref(dtype, t, i):
    gu = (torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i)) * 4).to(dtype)
    torch.testing.assert_close(ops.silu_mul(gu), ref.silu_mul(gu), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ops.isas())
def test_silu_mul_extremes_follow_float64(isa, dtype):
    """Gates far out in both tails, zeros, infinities and NaN, on every ISA variant built here (bf16: the
    AVX-512-BF16 vector path where the CPU has it): silu(g) * u of float64 rounded once, within one ulp of the
    dtype; inf and NaN where torch's silu gives them."""
    g = torch.tensor(
        [0.0, -0.0, 1e-3, -1e-3, 20.0, -20.0, 86.0, -86.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38]
        + [float("inf"), float("-inf"), float("nan")]
        + [0.5] * 4
    )  # 23 columns: a vector and a tail
    u = torch.linspace(-3.0, 3.0, g.numel())
    gu = torch.cat([g, u])[None].to(dtype)
    try:
        ops.cpu_isa(isa)
        got = ops.silu_mul(gu)[0].double()
    finally:
        ops.cpu_isa("auto")
    gd, ud = gu[0, : g.numel()].double(), gu[0, g.numel() :].double()
    want = (torch.nn.functional.silu(gd) * ud).to(dtype).double()
    finite = want.isfinite()
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-23
    torch.testing.assert_close(got[finite], want[finite], atol=1e-30, rtol=ulp)
    assert torch.equal(got[~finite].isnan(), want[~finite].isnan())
    assert torch.equal(got[want.isinf()], want[want.isinf()])


def test_rows_do_not_depend_on_the_batch():
    """Batch invariance: a row's result is bitwise the same alone and inside a larger batch."""
    g = torch.Generator().manual_seed(3)
    x, res, w = torch.randn(40, 576, generator=g), torch.randn(40, 576, generator=g), torch.rand(576, generator=g)
    full = ops.rmsnorm(x, w, 1e-5, res)[0]
    assert torch.equal(full[17:18], ops.rmsnorm(x[17:18], w, 1e-5, res[17:18])[0])
    gu = torch.randn(40, 3072, generator=g)
    assert torch.equal(ops.silu_mul(gu)[5:6], ops.silu_mul(gu[5:6]))


def test_smollm2_eager_forward_native_ops_match_reference_ops(smollm_runner):
    """The float32 SmolLM2 runner's eager forward uses the native ops; swapping in kernels.ref's gives the same
    logits within float32 rounding and the same argmax."""
    from runtime.models.llama import REF_ELEMENTWISE
    from tests.kernels.row_ops import logits_with_row_ops

    assert smollm_runner.model.ew.rmsnorm is ops.rmsnorm and smollm_runner.model.ew.fused_rope
    got, want = logits_with_row_ops(smollm_runner, REF_ELEMENTWISE)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("b,v", [(1, 31), (3, 64), (5, 1000), (32, 49152), (4, 49153)])
@pytest.mark.parametrize("subset", [False, True])
def test_apply_token_bitmask_matches_the_torch_twin(b, v, subset):
    """The one-pass grammar mask vs runtime.constrained's unpack_bitmask + masked_fill, on masks with all-allowed,
    all-banned and mixed words, a vocabulary that is not a multiple of 32, and a subset of the rows."""
    from runtime.constrained.grammar import unpack_bitmask

    g = torch.Generator().manual_seed(b * v)
    rows = list(range(0, b, 2)) if subset else list(range(b))
    words = (v + 31) // 32
    bm = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int32)
    bm[:, ::3] = 0  # every token of the word banned
    bm[:, 1::5] = -1  # every token allowed
    logits = torch.randn(b, v, generator=g)
    want = logits.clone()
    want[rows] = want[rows].masked_fill(unpack_bitmask(bm, v, allowed=False), float("-inf"))
    ops.apply_token_bitmask_(logits, bm, torch.tensor(rows) if subset else None)
    assert torch.equal(logits, want)


def test_apply_token_bitmask_refuses_bad_shapes():
    with pytest.raises(RuntimeError, match="words"):
        ops.apply_token_bitmask_(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.apply_token_bitmask_(torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.apply_token_bitmask_(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32))
