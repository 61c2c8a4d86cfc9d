"""The native CPU attention ops (kernels/cpu) against kernels/ref.py, over a sampled grid, plus SmolLM2 greedy.

Grid: batch 1-33, contexts 1-4,100, GQA ratios 1/3/8, page sizes 1 and 16, shared prefix on/off,
float32 and bfloat16. The full product would take minutes; each case below picks one point per axis so every
value of every axis appears, with the expensive corners (long contexts, big batches) kept few.
Tolerances: float32 1e-5 (the same math in another order); bfloat16 2e-2 (inputs are bf16, both sides
accumulate in float32, the outputs round to bf16 once).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import ref
from kernels.cpu import ops
from kernels.cpu.backend import CpuAttnBackend, shared_prefix_len
from tests.kernels.cpu_attention_params import DTYPE_GEMMS, Q_DTYPE
from tests.kernels.paged import make_paged_batch, step_meta

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-5}  # f16 pool: the same values both sides

# (batch, context range, GQA group, page size, shared prefix length, head_dim)
DECODE_GRID = [
    (1, (1, 1), 1, 1, 0, 64),
    (1, (4100, 4100), 3, 16, 0, 64),
    (5, (1, 90), 8, 1, 0, 128),
    (8, (300, 1700), 3, 16, 256, 64),
    (33, (70, 140), 3, 1, 64, 64),
    (17, (1, 600), 1, 16, 0, 32),
    (3, (2000, 4100), 8, 1, 1999, 64),
    (4, (100, 300), 3, 1, 80, 64),  # shared prefix on the row kernel (B*G < 16): 12 rows per KV head
    (2, (100, 300), 4, 16, 70, 128),  # the same with head_dim 128 (P.V two rows at a time)
]
EXTEND_GRID = [  # (prefix lens, extend lens, group, page, shared prefix, head_dim)
    ([0], [1], 1, 1, 0, 64),
    ([0, 0, 0], [37, 1, 70], 3, 16, 0, 64),
    ([5, 0, 300], [1, 33, 64], 8, 1, 0, 128),
    ([1500] * 6, [20, 60, 1, 45, 33, 7], 3, 1, 1500, 64),
    ([4000, 17], [100, 5], 1, 16, 0, 32),
    ([64, 64, 200, 90], [0, 3, 2, 31], 3, 16, 64, 64),
]


def _share(pb, shared: int) -> None:
    """Make every request's first `shared` slots those of the first request (as the radix cache does)."""
    rows = pb.req_pool_indices.tolist()
    for r in rows[1:]:
        pb.req_to_token[r, :shared] = pb.req_to_token[rows[0], :shared]


def _run(pb, prefix, extend, group, dtype, is_decode, seed=0):
    """One step through the native backend and through the reference; returns (got, want, caches, ref caches)."""
    g = torch.Generator().manual_seed(seed)
    hkv, d = pb.k_cache.shape[2], pb.k_cache.shape[3]
    meta = step_meta(pb, prefix, extend, is_decode)
    t = sum(extend)
    qd = Q_DTYPE.get(dtype, dtype)
    q = torch.randn(t, hkv * group, d, generator=g).to(qd)
    k = torch.randn(t, hkv, d, generator=g).to(qd)
    v = torch.randn(t, hkv, d, generator=g).to(qd)
    kr, vr = pb.k_cache[0].clone(), pb.v_cache[0].clone()
    ref.store_kv(kr, vr, meta.out_cache_loc, k, v)
    scale = d**-0.5
    if is_decode:
        want = ref.decode_attention(q, kr, vr, pb.req_to_token, pb.req_pool_indices, meta.seq_lens_cpu, scale)
    else:
        want = ref.extend_attention(q, kr, vr, pb.req_to_token, pb.req_pool_indices, tuple(prefix),
                                    tuple(extend), scale)
    backend = CpuAttnBackend(pb.k_cache, pb.v_cache, scale)
    backend.init_forward(meta)
    got = backend.forward(q, k, v, 0)
    return got, want, backend, (kr, vr)


@pytest.mark.parametrize(("dtype", "bf16_gemm"), DTYPE_GEMMS, indirect=["bf16_gemm"])
@pytest.mark.parametrize("case", DECODE_GRID, ids=[f"B{c[0]}-ctx{c[1][1]}-G{c[2]}-P{c[3]}-S{c[4]}" for c in DECODE_GRID])
def test_decode_matches_reference(case, dtype, bf16_gemm) -> None:
    batch, (lo, hi), group, page, shared, d = case
    g = torch.Generator().manual_seed(batch * 7 + hi)
    seq = torch.randint(max(lo, shared + 1), hi + 1, (batch,), generator=g).tolist()
    prefix = [s - 1 for s in seq]
    pb = make_paged_batch(prefix, [1] * batch, 3 if group < 8 else 2, d, page_size=page, dtype=dtype, seed=batch)
    _share(pb, shared)
    got, want, backend, (kr, vr) = _run(pb, prefix, [1] * batch, group, dtype, True)
    if shared >= 64 and batch > 1:
        assert backend._dec.shared_len >= shared  # the shared-prefix pass ran
    assert torch.equal(pb.k_cache[0], kr) and torch.equal(pb.v_cache[0], vr)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "bf16_gemm"), DTYPE_GEMMS, indirect=["bf16_gemm"])
@pytest.mark.parametrize("case", EXTEND_GRID, ids=[f"E{sum(c[1])}-G{c[2]}-P{c[3]}-S{c[4]}" for c in EXTEND_GRID])
def test_extend_matches_reference(case, dtype, bf16_gemm) -> None:
    prefix, extend, group, page, shared, d = case
    pb = make_paged_batch(prefix, extend, 2, d, page_size=page, dtype=dtype, seed=len(prefix))
    _share(pb, shared)
    got, want, backend, (kr, vr) = _run(pb, prefix, extend, group, dtype, False)
    if shared >= 64:
        assert backend._ext.shared_len >= shared
    assert torch.equal(pb.k_cache[0], kr) and torch.equal(pb.v_cache[0], vr)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "bf16_gemm"), DTYPE_GEMMS, indirect=["bf16_gemm"])
def test_mixed_step_matches_reference(dtype, bf16_gemm) -> None:
    """Rows [0, 3) decode, rows [3, 6) extend (one over the decode rows' shared prefix): one step, two op calls."""
    prefix, extend = [300, 300, 80, 300, 0, 40], [1, 1, 1, 50, 7, 1]
    pb = make_paged_batch(prefix, extend, 3, 64, dtype=dtype, seed=11)
    rows = pb.req_pool_indices.tolist()
    for r in (rows[1], rows[3]):
        pb.req_to_token[r, :256] = pb.req_to_token[rows[0], :256]
    g = torch.Generator().manual_seed(1)
    meta = dataclasses.replace(step_meta(pb, prefix, extend, False), num_decode=3)
    t = sum(extend)
    q, k, v = (torch.randn(t, h, 64, generator=g).to(Q_DTYPE.get(dtype, dtype)) for h in (9, 3, 3))
    kr, vr = pb.k_cache[0].clone(), pb.v_cache[0].clone()
    ref.store_kv(kr, vr, meta.out_cache_loc, k, v)
    want = ref.extend_attention(q, kr, vr, pb.req_to_token, pb.req_pool_indices, tuple(prefix), tuple(extend),
                                0.125)
    backend = CpuAttnBackend(pb.k_cache, pb.v_cache, 0.125)
    backend.init_forward(meta)
    got = backend.forward(q, k, v, 0)
    assert torch.equal(pb.k_cache[0], kr) and torch.equal(pb.v_cache[0], vr)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # all rows as extend rows (the base seam's extend()) gives the same answer
    torch.testing.assert_close(backend.extend(q, k, v, 0).float(), want.float(), atol=tol, rtol=tol)


def test_shared_prefix_len_stops_at_first_difference() -> None:
    pb = make_paged_batch([300, 300, 300], [1, 1, 1], 1, 16, seed=3)
    _share(pb, 200)
    limits = (300, 300, 300)
    assert shared_prefix_len(pb.req_to_token, pb.req_pool_indices, limits) == 200
    assert shared_prefix_len(pb.req_to_token, pb.req_pool_indices, (300, 150, 300)) == 150
    assert shared_prefix_len(pb.req_to_token, pb.req_pool_indices[:1], limits[:1]) == 0
    pb2 = make_paged_batch([300, 300], [1, 1], 1, 16, seed=4)
    _share(pb2, 30)  # under the minimum: read per request
    assert shared_prefix_len(pb2.req_to_token, pb2.req_pool_indices, (300, 300)) == 0


def test_ops_pass_opcheck() -> None:
    """Schemas (declared cache mutation), fake kernels and the eager kernels agree (torch.library.opcheck)."""
    ops.load()
    pb = make_paged_batch([40, 70], [1, 1], 3, 64, seed=5)
    meta = step_meta(pb, [40, 70], [1, 1], True)
    q, k, v = torch.randn(2, 9, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    args = (q, k, v, pb.k_cache, pb.v_cache, 0, meta.out_cache_loc, pb.req_to_token, pb.req_pool_indices,
            meta.seq_lens, 0, 0.125)
    torch.library.opcheck(torch.ops.radixgen.attn_decode.default, args)
    pb = make_paged_batch([40, 0], [5, 9], 3, 64, seed=6)
    meta = step_meta(pb, [40, 0], [5, 9], False)
    q, k, v = torch.randn(14, 9, 64), torch.randn(14, 3, 64), torch.randn(14, 3, 64)
    args = (q, k, v, pb.k_cache, pb.v_cache, 0, meta.out_cache_loc, pb.req_to_token, pb.req_pool_indices,
            meta.prefix_lens, meta.extend_lens, 0, 0.125)
    torch.library.opcheck(torch.ops.radixgen.attn_extend.default, args)


def test_bad_inputs_fail_loud() -> None:
    ops.load()
    pb = make_paged_batch([4], [1], 1, 64, seed=7)
    meta = step_meta(pb, [4], [1], True)
    q = torch.randn(1, 1, 64, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.radixgen.attn_decode(q, q[:, :1], q[:, :1], pb.k_cache, pb.v_cache, 0, meta.out_cache_loc,
                                       pb.req_to_token, pb.req_pool_indices, meta.seq_lens, 0, 0.125)
    q = torch.randn(1, 1, 64)
    for bad in (-1, pb.req_to_token.shape[1]):  # a row shorter than shared_len only skips the shared pass
        with pytest.raises(RuntimeError, match="shared prefix"):
            torch.ops.radixgen.attn_decode(q, q, q, pb.k_cache, pb.v_cache, 0, meta.out_cache_loc,
                                           pb.req_to_token, pb.req_pool_indices, meta.seq_lens, bad, 0.125)


def test_smollm_greedy_equals_torch_backend(smollm_runner) -> None:
    """float32 SmolLM2: greedy continuations through the native backend equal the torch backend's."""
    from kernels import create_attn_backend
    from runtime.executor.greedy import greedy_generate

    runner = smollm_runner
    saved = runner.attn
    prompts = [list(range(100, 100 + n)) for n in (5, 70, 150)] + [[7, 8, 9] * 20]
    outs = {}
    try:
        for name in ("torch", "cpu"):
            runner.attn = create_attn_backend(name, runner.pool.k_cache, runner.pool.v_cache, saved.scale)
            outs[name] = greedy_generate(runner, prompts, 12)
    finally:
        runner.attn = saved
    assert outs["cpu"] == outs["torch"]


def test_auto_falls_back_to_torch_when_the_build_fails(monkeypatch, caplog) -> None:
    """Auto-selected: a toolchain failure costs one warning and the torch backend; asked for by name: it raises."""
    from kernels import create_attn_backend, fallbacks
    from kernels.cpu import build
    from kernels.torch_backend import TorchAttnBackend

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'radixgen_cpu_attn': g++ not found")

    monkeypatch.setattr(build, "load", broken)
    monkeypatch.setattr(fallbacks, "_recorded", {})  # one warning per part and process: start this test fresh
    kc = torch.zeros(1, 8, 1, 64)
    with caplog.at_level("WARNING"):
        backend = create_attn_backend("auto", kc, kc.clone(), 0.125)
    assert isinstance(backend, TorchAttnBackend)
    assert [r.message for r in caplog.records
            if r.message.startswith("fallback: attention_backend: native cpu kernels unavailable")]
    assert "g++ not found" in fallbacks.recorded()["attention_backend"]
    with pytest.raises(RuntimeError, match="g\\+\\+ not found"):
        create_attn_backend("cpu", kc, kc.clone(), 0.125)


def test_bf16_attn_gemm_selects_and_restores() -> None:
    auto = ops.bf16_attn_gemm("auto")
    assert auto in ("f32", "dot", "brgemm")
    assert ops.bf16_attn_gemm("dot") == "dot" and ops.bf16_attn_gemm("f32") == "f32"
    with pytest.raises(RuntimeError, match="unknown mode"):
        ops.bf16_attn_gemm("amx")
    assert ops.bf16_attn_gemm("f32") == "f32"  # a refused mode changes nothing
    assert ops.bf16_attn_gemm("auto") == auto
