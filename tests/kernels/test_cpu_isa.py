"""Every ISA variant of the native CPU ops this machine can execute (kernels/cpu/isa.h: avx512, avx2, portable),
forced in turn through kernels.cpu.ops.cpu_isa, against torch / float64 references over a grid of shapes; batch
invariance where the kernels claim it; the dispatch's own errors and the ops' bad-input errors in every variant.

A variant is skipped only where this CPU lacks its instructions; where it has them, the variant must be built.
Tolerances: float32 GEMM/GEMV against float64 within float32 accumulation over K; the block GEMVs within the
int8-activation bound (tests/kernels/quant_ref.py); row ops and attention as their own tests
(tests/kernels/test_cpu_elementwise.py, tests/kernels/test_cpu_attention.py); the shared exp polynomial through
silu_mul against float64 to 2e-6 relative over [-90, 90].
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import ref
from kernels.cpu import build, ops
from kernels.cpu.backend import CpuAttnBackend
from tests.kernels.cpu_attention_params import Q_DTYPE
from tests.kernels.paged import make_paged_batch, step_meta
from tests.kernels.quant_ref import q8_activation_bound

ISAS = ["avx512", "avx2", "portable"]


@pytest.fixture(params=ISAS)
def isa(request) -> Iterator[str]:
    """Forces one variant for the test; skips where this CPU cannot run it; back to auto afterwards."""
    name = request.param
    if name not in build.isas():
        pytest.skip(f"this CPU lacks the instructions of the {name} variant")
    ops.load()
    assert name in ops.isas(), f"the {name} variant runs on this CPU but was not built"
    assert ops.cpu_isa(name) == name
    try:
        yield name
    finally:
        ops.cpu_isa("auto")


def test_dispatch_picks_the_best_and_refuses_unknown_variants() -> None:
    ops.load()
    built = ops.isas()
    assert built == build.isas() and built[-1] == "portable"
    assert ops.cpu_isa("auto") == built[0]
    ops.cpu_isa("portable")
    with pytest.raises(RuntimeError, match="not a variant built for this CPU"):
        ops.cpu_isa("sse9")
    assert ops.cpu_isa("portable") == "portable"  # the refused mode changed nothing
    assert not ops.panels_native() and not ops.q_gemv_native()  # the forced variant is the one that runs
    for name in built[:-1]:
        ops.cpu_isa(name)
        assert ops.panels_native() and ops.q_gemv_native()
    if "avx2" not in built:
        with pytest.raises(RuntimeError, match="not a variant"):
            ops.cpu_isa("avx2")
    assert ops.cpu_isa("auto") == built[0]


# --- GEMM: column panels ---------------------------------------------------------------------------------------

PANEL_GRID = [(1, 576, 1536), (5, 576, 576), (7, 1536, 576), (96, 100, 48), (97, 576, 192), (512, 576, 1536)]


@pytest.mark.parametrize("m,k,n", PANEL_GRID)
def test_linear_panels_matches_float64(isa: str, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 31 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    y = ops.linear_panels(x, ops.pack_panels(w))
    want = x.double() @ w.double().t()
    bound = 4e-7 * k**0.5 * (x.double().abs() @ w.double().abs().t()) + 1e-6
    assert ((y.double() - want).abs() <= bound).all()
    # batch-invariant: any row alone gives the same bits
    for r in (0, m - 1):
        assert torch.equal(ops.linear_panels(x[r : r + 1], ops.pack_panels(w)), y[r : r + 1])


def test_linear_panels_same_bits_in_every_vector_variant() -> None:
    """AVX-512 and AVX2 tiles both take one fused multiply-add per k in order: the same bits."""
    ops.load()
    vector = [v for v in ops.isas() if v != "portable"]
    if len(vector) < 2:
        pytest.skip("this CPU runs one vector variant only")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(29, 576, generator=g), torch.randn(80, 576, generator=g)
    try:
        outs = [(ops.cpu_isa(v), ops.linear_panels(x, ops.pack_panels(w)))[1] for v in vector]
    finally:
        ops.cpu_isa("auto")
    assert all(torch.equal(outs[0], o) for o in outs[1:])


# --- GEMV: Q4_1 / Q8_0 blocks ----------------------------------------------------------------------------------


def _q4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q4_1 weights (qs, dm) and their float32 values [N, K] (GGUF nibble order, W = d q + m)."""
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    dm = (torch.randn(n, 2, k // 32, generator=g) * 0.02).half()
    b = qs.view(n, k // 32, 16).int()
    q = torch.cat([b & 0x0F, b >> 4], dim=2).float()  # [N, nb, 32]: codes 0-15 low nibbles, 16-31 high
    w = q * dm[:, 0].float()[..., None] + dm[:, 1].float()[..., None]
    return qs, dm, w.reshape(n, k)


def _q8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.randn(n, k // 32, generator=g) * 0.002).half()
    w = codes.float().view(n, k // 32, 32) * d.float()[..., None]
    return codes, d, w.reshape(n, k)


GEMV_GRID = [(1, 576, 576), (1, 1536, 576), (3, 96, 49), (4, 576, 1536), (7, 160, 64), (64, 576, 96)]


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("m,k,n", GEMV_GRID)
def test_block_gemv_within_activation_rounding(isa: str, kind: str, m: int, k: int, n: int) -> None:
    a, b, w = (_q4 if kind == "q4" else _q8)(n, k, seed=m + k + n)
    fn = ops.q4_linear if kind == "q4" else ops.q8_linear
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # uneven block magnitudes
    y = fn(x, a, b)
    want = x @ w.t()
    assert ((y - want).abs() <= q8_activation_bound(x, w)).all()
    assert (y - want).norm() < 0.015 * want.norm()
    assert torch.equal(fn(x[m - 1 :], a, b), y[m - 1 :])  # batch-invariant


# --- elementwise -----------------------------------------------------------------------------------------------

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ops_match_ref(isa: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    for t, h in ((1, 576), (33, 100)):
        x, res = (torch.randn(t, h, generator=g) * 3).to(dtype), torch.randn(t, h, generator=g).to(dtype)
        w = (torch.rand(h, generator=g) + 0.5).to(dtype)
        out, hsum = ops.rmsnorm(x, w, 1e-5, res)
        want, want_h = ref.rmsnorm(x, w, 1e-5, res)
        torch.testing.assert_close(out, want, **TOL[dtype])
        assert torch.equal(hsum, want_h)
    q = torch.randn(17, 9, 64, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (17,), generator=g)
    cos_sin = ref.rope_cos_sin(64, 4096, 10000.0)
    torch.testing.assert_close(ops.rope(q, cos_sin, pos), ref.apply_rope(q, q, pos, cos_sin)[0], **TOL[dtype])
    gu = (torch.randn(9, 2 * 100, generator=g) * 4).to(dtype)
    torch.testing.assert_close(ops.silu_mul(gu), ref.silu_mul(gu), **TOL[dtype])
    with pytest.raises(RuntimeError, match="out of the cos/sin table"):
        ops.rope(q, cos_sin, torch.full((17,), 4096))


def test_exp_polynomial_through_silu(isa: str) -> None:
    """silu(g) = g / (1 + exp(-g)) over [-90, 90], float32 against float64: the shared exp to ~2e-7."""
    gate = torch.linspace(-90, 90, 4099)
    gu = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    g64 = gate.double()
    want = g64 / (1 + torch.exp(-g64))
    got = ops.silu_mul(gu)[0].double()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


# --- attention -------------------------------------------------------------------------------------------------


def _attend(dtype: torch.dtype, prefix: list[int], extend: list[int], group: int, d: int, shared: int) -> None:
    decode = all(e == 1 for e in extend) and all(p > 0 for p in prefix)
    pb = make_paged_batch(prefix, extend, 2, d, page_size=16, dtype=dtype, seed=len(prefix) + d)
    rows = pb.req_pool_indices.tolist()
    for r, p in zip(rows[1:], prefix[1:], strict=True):  # rows shorter than the shared prefix keep their slots
        if p >= shared:
            pb.req_to_token[r, :shared] = pb.req_to_token[rows[0], :shared]
    g = torch.Generator().manual_seed(d)
    t = sum(extend)
    qd = Q_DTYPE.get(dtype, dtype)  # a float16 pool under float32 q
    q, k, v = (torch.randn(t, h, d, generator=g).to(qd) for h in (2 * group, 2, 2))
    meta = step_meta(pb, prefix, extend, decode)
    kr, vr = pb.k_cache[0].clone(), pb.v_cache[0].clone()
    ref.store_kv(kr, vr, meta.out_cache_loc, k, v)
    scale = d**-0.5
    if decode:
        want = ref.decode_attention(q, kr, vr, pb.req_to_token, pb.req_pool_indices, meta.seq_lens_cpu, scale)
    else:
        want = ref.extend_attention(q, kr, vr, pb.req_to_token, pb.req_pool_indices, tuple(prefix), tuple(extend),
                                    scale)
    backend = CpuAttnBackend(pb.k_cache, pb.v_cache, scale)
    backend.init_forward(meta)
    got = backend.forward(q, k, v, 0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


ATTN_GRID = [  # (prefix lens, extend lens, group, head_dim, shared prefix)
    ([90, 300, 17], [1, 1, 1], 3, 64, 0),  # decode, row kernel
    ([200] * 6, [1] * 6, 3, 64, 128),  # decode, shared prefix through brgemm (B*G >= 16)
    ([200] * 6 + [3, 40], [1] * 8, 3, 64, 128),  # decode, two rows shorter than the shared prefix read their own
    ([40, 100], [1, 1], 1, 128, 0),  # decode, head_dim 128
    ([0, 70], [37, 20], 3, 64, 0),  # extend through brgemm
    ([100, 100], [9, 30], 2, 48, 64),  # extend, head_dim 48: the row kernel
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ATTN_GRID, ids=[f"E{sum(c[1])}-G{c[2]}-D{c[3]}-S{c[4]}" for c in ATTN_GRID])
def test_attention_matches_reference(isa: str, dtype: torch.dtype, case) -> None:
    _attend(dtype, *case)


# --- bad input: the same loud errors in every variant ----------------------------------------------------------


def test_bad_inputs_raise(isa: str) -> None:
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="K of x"):
        ops.linear_panels(x, ops.pack_panels(torch.randn(32, 96)))
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear_panels(x.double(), ops.pack_panels(torch.randn(32, 64)))
    qs, dm, _ = _q4(16, 64, seed=0)
    with pytest.raises(RuntimeError, match="K of x"):
        ops.q4_linear(torch.randn(2, 96), qs, dm)
    with pytest.raises(RuntimeError, match="dm must be"):
        ops.q4_linear(x, qs, dm.float())
    codes, d, _ = _q8(16, 64, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q8_linear(torch.randn(2, 48), codes[:, :48].contiguous(), d[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="silu_mul"):
        ops.silu_mul(torch.randn(3, 5))
