"""kernels.quant: GGUF blocks exact both ways, the quantized linears vs their dequantized reference.

Tolerances. GGUF unpack/pack and dequantize: exact (bytes and float32 bits). The CPU int4/int8 kernels take
bfloat16 activations and return bfloat16: the reference is x rounded to bf16 times the dequantized weight in
float32, and the error allowed is 2^-7 of the output's max (bf16 output rounding plus accumulation order).
The native CPU kernels (kernels/cpu/quant_gemv.cpp, --quantization-kernel native) round x to int8 per block of
32: the error allowed is that rounding's own bound, sum over blocks of max|x_b| / 254 * sum|w_b| (plus 1e-5 of
|x| @ |w|^T for float32 sums). CPU tests run under both kernels (the `cpu_kernel` fixture).
The Triton kernel with float32 x dots in IEEE float32: 1e-5 relative to the output's max.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu import ops
from kernels.quant import (
    QuantEmbedding,
    cat_rows,
    from_gguf,
    gguf_blocks,
    linear,
    quantize,
    rtn,
    set_cpu_kernel,
    to_kernel,
)
from kernels.quant.weights import Fp8Weight, Int4Weight, Int8Weight
from tests.kernels.native import require_native_blocks
from tests.kernels.quant_ref import q8_activation_bound, random_blocks

GGUF_TYPES = {k: getattr(gguf.GGMLQuantizationType, k) for k in gguf_blocks.KINDS}


@pytest.mark.parametrize("kind", gguf_blocks.KINDS)
@pytest.mark.parametrize("n,k", [(3, 256), (64, 512)])
def test_gguf_blocks_unpack_pack_exact(kind: str, n: int, k: int) -> None:
    raw = random_blocks(kind, n, k, seed=n + k)
    blocks = gguf_blocks.unpack(raw, kind)
    assert blocks.codes.shape == (n, k)
    assert np.array_equal(gguf_blocks.pack(blocks), raw)
    ref = gguf.quants.dequantize(raw, GGUF_TYPES[kind]).reshape(n, k)
    assert np.array_equal(gguf_blocks.dequantize(blocks).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_group_affine_matches_file_values(kind: str) -> None:
    raw = random_blocks(kind, 8, 512, seed=1)
    blocks = gguf_blocks.unpack(raw, kind)
    codes, scale, zero = gguf_blocks.group_affine(blocks)
    ref = torch.from_numpy(gguf_blocks.dequantize(blocks))
    # Q4_1 / Q4_K's zero = m + 8 d carries one float32 rounding: a few ulps of the largest value
    torch.testing.assert_close(rtn.dequantize_int4(codes, scale, zero), ref, rtol=0, atol=1e-6 * ref.abs().max())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("triton", [False, True])
def test_int4_weight_repacks_gguf_codes_exactly(kind: str, triton: bool) -> None:
    blocks = gguf_blocks.unpack(random_blocks(kind, 128, 256, seed=2), kind)
    w = Int4Weight(*gguf_blocks.group_affine(blocks), "cpu", triton=triton)
    assert torch.equal(w.codes(), torch.from_numpy(blocks.codes))
    back = gguf_blocks.Blocks(kind, w.codes().numpy(), blocks.params)
    assert np.array_equal(gguf_blocks.pack(back), gguf_blocks.pack(blocks))


def test_smollm_gguf_tensors_round_trip(smollm_path: str) -> None:
    """The shipped file: the first Q4_1 tensor and the Q8_0 embedding, bytes and values exact, and the CPU
    kernel's layout unpacks to the same codes."""
    reader = gguf.GGUFReader(smollm_path)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in gguf_blocks.KINDS or kind in seen:
            continue
        seen.add(kind)
        raw = t.data[:2048]  # the first 2048 rows of each (the whole embedding costs seconds)
        blocks = gguf_blocks.unpack(raw, kind)
        assert np.array_equal(gguf_blocks.pack(blocks), raw)
        ref = gguf.quants.dequantize(raw, t.tensor_type).reshape(blocks.codes.shape)
        assert np.array_equal(gguf_blocks.dequantize(blocks), ref)
        if kind == "Q8_0":
            emb = QuantEmbedding(from_gguf(blocks), torch.float32, "cpu")
            ids = torch.tensor([0, 5, 2047, 5])
            assert torch.equal(emb(ids), torch.from_numpy(ref)[ids])
        else:
            assert torch.equal(to_kernel(from_gguf(blocks), "cpu").codes(), torch.from_numpy(blocks.codes))
    assert seen == {"Q4_1", "Q8_0"}


@pytest.fixture(params=["torch", "native"])
def cpu_kernel(request: pytest.FixtureRequest):
    """Packs CPU weights for torch's kernels or the native block kernels for the test, then back to auto."""
    if request.param == "native":
        require_native_blocks()
    set_cpu_kernel(request.param)
    yield request.param
    set_cpu_kernel("auto")


def assert_kernel_close(kernel: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y from `kernel` vs x @ w^T (x [M, K], w the dequantized weight [N, K]), within that kernel's tolerance."""
    if kernel == "native":
        ref = x.float() @ w.t()
        bound = q8_activation_bound(x, w)
        if y.dtype == torch.bfloat16:  # the output's own rounding
            bound = bound + ref.abs() * 2**-8
        assert ((y.float() - ref).abs() <= bound).all(), (y.float() - ref).abs().max()
    else:
        _assert_bf16_close(y, _bf16_ref(x, w))


def _bf16_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float() @ w.t()


def _assert_bf16_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    err = (y.float() - ref).abs().max().item()
    assert err <= 2**-7 * ref.abs().max().item() + 1e-6, err


SHAPES = [(1, 64, 128), (3, 192, 256), (32, 128, 512), (17, 576, 128), (300, 128, 256)]  # (M, N, K); M >= 256: dense


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4_linear_matches_reference(m: int, n: int, k: int, group: int, dtype: torch.dtype,
                                           cpu_kernel: str) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    qw = to_kernel(quantize(w, "int4", group), "cpu")
    x = torch.randn(2, m, k, generator=g).to(dtype)  # a leading batch dim: linear flattens it
    y = linear(x, qw)
    assert y.shape == (2, m, n) and y.dtype == dtype
    if m >= 256:  # the dense path: x in its dtype times the dequantized weight
        _assert_bf16_close(y.reshape(-1, n), _bf16_ref(x.reshape(-1, k), qw.dequantize()))
    else:
        assert_kernel_close(cpu_kernel, y.reshape(-1, n), x.reshape(-1, k), qw.dequantize())
    assert torch.equal(qw.codes(), rtn.quantize_int4(w, group)[0])


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_cpu_int8_linear_matches_reference(m: int, n: int, k: int, cpu_kernel: str) -> None:
    g = torch.Generator().manual_seed(m * n)
    w = torch.randn(n, k, generator=g) * 0.05
    qw = to_kernel(quantize(w, "int8", 0), "cpu")
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    if m >= 256:
        _assert_bf16_close(linear(x, qw, bias), _bf16_ref(x, qw.dequantize()) + bias)
    else:
        assert_kernel_close(cpu_kernel, linear(x, qw, bias) - bias, x, qw.dequantize())


def test_fused_rows_and_q8_0_on_cpu(cpu_kernel: str) -> None:
    """cat_rows fuses QKV-style parts exactly; a grouped int8 (Q8_0) weight keeps its file values exactly under
    the native kernels and runs per-channel under torch's, within half a per-channel step of them."""
    g = torch.Generator().manual_seed(5)
    parts = [quantize(torch.randn(n, 128, generator=g), "int4", 32) for n in (64, 128)]
    fused = cat_rows(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    blocks = gguf_blocks.unpack(random_blocks("Q8_0", 64, 256, seed=6), "Q8_0")
    q = from_gguf(blocks)
    w = to_kernel(q, "cpu")
    if cpu_kernel == "native":
        assert torch.equal(w.dequantize(), q.dequantize())
        return
    step = w.scale.float()  # [N, 1], bfloat16 on CPU: |q| <= 127 codes times a 2^-9 relative scale error
    assert ((w.dequantize() - q.dequantize()).abs() <= step / 2 + 127 * step * 2**-8).all()


def test_rtn_error_within_half_a_step() -> None:
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    codes, scale, zero = rtn.quantize_int4(w, 32)
    err = (rtn.dequantize_int4(codes, scale, zero) - w).abs().reshape(16, 8, 32)
    assert (err <= scale[..., None] / 2 + 1e-6).all()
    codes8, scale8 = rtn.quantize_int8(w)
    err8 = (rtn.dequantize_scaled(codes8, scale8) - w).abs()
    assert (err8 <= scale8 / 2 + 1e-6).all()


@pytest.mark.parametrize("m,n,k,group", [(1, 64, 64, 32), (5, 96, 128, 64), (33, 80, 96, 32)])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_triton_dequant_mm_matches_reference(m: int, n: int, k: int, group: int, kind: str) -> None:
    """The Triton kernel (interpreter on CPU; compiled on CUDA) in float32, odd M/N tails included."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        pytest.importorskip("triton")
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 (set by tests/kernels/conftest.py before the first import)")
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "int4":
        qw = Int4Weight(*rtn.quantize_int4(w, group), dev, triton=True)
    elif kind == "int8":
        qw = Int8Weight(*rtn.quantize_int8(w, group), dev, triton=True)
    else:
        qw = Fp8Weight(*rtn.quantize_fp8(w, group), dev)
    x = torch.randn(m, k, generator=g).to(dev)
    ref = x.cpu() @ qw.dequantize().t()
    torch.testing.assert_close(qw(x).cpu(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_kept_dense_copies_dispatch_by_rows_and_equal_the_per_call_dequant(dtype, cpu_kernel: str) -> None:
    """keep_dense_copies: each CPU int4/int8 weight gets a copy in the model's dtype equal to its per-call
    dequantization for activations of that dtype; calls with >= min_rows rows run on it (same result as the
    per-call dense path), fewer rows the quantized kernel (same result as without a copy); the bytes added are
    2 (bf16) or 4 (float32) per parameter; weights it cannot unpack are left (torch's int4 layout at N = 80)."""
    from kernels.quant import keep_dense_copies

    g = torch.Generator().manual_seed(9)
    w = torch.randn(128, 256, generator=g) * 0.05
    model = torch.nn.ModuleList([to_kernel(quantize(w, "int4", 32), "cpu"), to_kernel(quantize(w, "int8", 0), "cpu"),
                                 to_kernel(quantize(w[:80], "int4", 32), "cpu")])  # N = 80: torch's, no unpack
    x1, x8, x300 = (torch.randn(n, 256, generator=g).to(dtype) for n in (1, 8, 300))
    before = [(linear(x1, m), linear(x8, m), linear(x300, m)) for m in model]
    size = torch.empty((), dtype=dtype).element_size()
    odd_copied = cpu_kernel == "native"  # the block layout unpacks at any N
    assert keep_dense_copies(model, 8, dtype) == size * 256 * (2 * 128 + 80 * odd_copied)
    w4, w8, odd = model
    assert (odd.dense is None) != odd_copied and w4.dense.dtype == w8.dense.dtype == dtype
    # float32 on an AVX2 CPU without AVX-512: the copies are column panels for kernels/cpu/linear.cpp
    panels = dtype == torch.float32 and ops.panels_preferred()
    assert w4.dense.dim() == (3 if panels else 2)

    def matrix(m):
        return ops.unpack_panels(m.dense) if panels else m.dense

    assert torch.equal(matrix(w4), w4.dense_weight(dtype)) and torch.equal(matrix(w8), w8.dense_weight(dtype))
    for m, (y1, y8, y300) in zip(model, before, strict=True):
        assert torch.equal(linear(x1, m), y1)  # 1 row: the quantized kernel, as before
        if m.dense is not None:
            ref8 = torch.nn.functional.linear(x8, matrix(m))
            if panels:  # another summation order than MKL's: float32 rounding apart
                torch.testing.assert_close(linear(x8, m), ref8, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(linear(x300, m), y300, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(linear(x8, m), ref8)
                assert torch.equal(linear(x300, m), y300)  # the per-call dense path computed the same GEMM
            assert_kernel_close(cpu_kernel, y8, x8, m.dequantize())  # what the quantized kernel gave before
    assert "dense" in dict(w4.named_buffers())  # a buffer: compiled forwards freeze and prepack it


def test_quantized_linear_compiles_fullgraph(cpu_kernel: str) -> None:
    """The CPU weight-only ops trace under torch.compile (the engine's compiled forward) and match eager."""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    w4, w8 = to_kernel(quantize(w, "int4", 32), "cpu"), to_kernel(quantize(w, "int8", 0), "cpu")
    x = torch.randn(4, 256)

    def f(x: torch.Tensor) -> torch.Tensor:
        return linear(torch.relu(linear(x, w4)).repeat(1, 2), w8)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # traceability; inductor keeps aten externs
    torch.testing.assert_close(compiled(x), f(x), rtol=2e-2, atol=2e-2)


def test_unsupported_kinds_fail_loud(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="Q5_K cannot be kept quantized"):
        gguf_blocks.unpack(np.zeros((1, 176), np.uint8), "Q5_K")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="fp8 weights run on CUDA only"):
        Fp8Weight(torch.zeros(4, 32), torch.ones(4, 1), "cpu")
    with pytest.raises(ValueError, match="per output channel"):
        Int8Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_gpu_dequant_mm_bf16_model_shapes(m: int, kind: str) -> None:
    n, k = 1536, 576
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(m)) * 0.05
    qw = to_kernel(quantize(w, kind, 32), "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float().cpu() @ qw.dequantize().to(torch.bfloat16).float().t()
    _assert_bf16_close(qw(x).float().cpu(), ref)
