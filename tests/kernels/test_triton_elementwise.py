"""Triton store_kv, fused add + RMSNorm and rotary embedding vs kernels.ref (fp32).

store_kv is a copy: exact. RMSNorm and rope: atol = rtol = 1e-5 (same float32 math, different order).
"""

from __future__ import annotations

import pytest
import torch

from kernels import ref

pytest.importorskip("triton")

from kernels.triton.rmsnorm import rmsnorm  # noqa: E402
from kernels.triton.rope import apply_rope  # noqa: E402
from kernels.triton.store_kv import store_kv  # noqa: E402

ATOL = RTOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("hkv,d", [(1, 16), (3, 32), (8, 16)])
def test_store_kv_matches_ref_with_strided_inputs(device: str, hkv: int, d: int) -> None:
    t, slots = 11, 64
    qkv = torch.randn(t, 2 + 2 * hkv, d, generator=_gen(0)).to(device)
    k, v = qkv[:, 2 : 2 + hkv], qkv[:, 2 + hkv :]  # non-contiguous views, as split from a fused projection
    loc = torch.randperm(slots, generator=_gen(1))[:t].to(device)
    kc = torch.randn(2, slots, hkv, d, generator=_gen(2)).to(device)
    vc = torch.randn(2, slots, hkv, d, generator=_gen(3)).to(device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(kc[1], vc[1], loc, k, v)
    ref.store_kv(kc_ref[1], vc_ref[1], loc, k, v)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("hidden", [64, 48])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_ref(device: str, hidden: int, with_residual: bool) -> None:
    x = torch.randn(2, 5, hidden, generator=_gen(4)).to(device)
    w = torch.randn(hidden, generator=_gen(5)).to(device)
    res = torch.randn(2, 5, hidden, generator=_gen(6)).to(device) if with_residual else None
    out, h = rmsnorm(x, w, 1e-6, res)
    out_ref, h_ref = ref.rmsnorm(x, w, 1e-6, res)
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=RTOL)
    assert out.shape == x.shape and h.shape == x.shape


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (9, 3, 32), (24, 3, 16)])
def test_rope_matches_ref(device: str, hq: int, hkv: int, d: int) -> None:
    t = 13
    cos_sin = ref.rope_cos_sin(d, 200, 10000.0, device=device)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=_gen(7)).to(device)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]  # strided views
    pos = torch.randint(0, 200, (t,), generator=_gen(8)).to(device)
    q_out, k_out = apply_rope(q, k, pos, cos_sin)
    q_ref, k_ref = ref.apply_rope(q, k, pos, cos_sin)
    torch.testing.assert_close(q_out, q_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(k_out, k_ref, atol=ATOL, rtol=RTOL)


def test_rope_llama3_scaled_table(device: str) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    cos_sin = ref.rope_cos_sin(32, 512, 500000.0, scaling, device=device)
    q = torch.randn(6, 4, 32, generator=_gen(9)).to(device)
    k = torch.randn(6, 2, 32, generator=_gen(10)).to(device)
    pos = torch.tensor([0, 1, 63, 64, 300, 511], device=device)
    got, want = apply_rope(q, k, pos, cos_sin), ref.apply_rope(q, k, pos, cos_sin)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_model_forward_with_triton_norm_and_rope_matches_ref(smollm_runner) -> None:
    """What the CUDA model runs (runtime.models.llama.elementwise_kernels): SmolLM2's forward with the Triton
    RMSNorm and rope (interpreted here) gives the reference forward's logits and argmax."""
    from runtime.models.llama import Elementwise, elementwise_kernels
    from tests.kernels.row_ops import logits_with_row_ops

    assert elementwise_kernels("cpu", torch.float64) == (ref.rmsnorm, ref.apply_rope, ref.silu_mul)
    want, got = logits_with_row_ops(smollm_runner, Elementwise(rmsnorm, apply_rope, ref.silu_mul))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
