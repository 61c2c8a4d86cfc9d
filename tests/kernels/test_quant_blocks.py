"""kernels/cpu/quant_gemv.cpp through kernels/quant/cpu_blocks.py: GGUF blocks repacked exactly, the native q4/q8
linears vs their float32 reference within the int8-activation bound, batch and thread invariance, loud shape errors.

Tolerance: the kernels round each row of x to int8 per block of 32 (step max|x_b| / 127), so |y - x @ W^T| is at
most sum_b max|x_b| / 254 * sum|W_b| plus float32 accumulation (tests/kernels/quant_ref.py).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu import ops
from kernels.quant import (
    Q4BlockWeight,
    Q8BlockWeight,
    from_gguf,
    gguf_blocks,
    quantize,
    set_cpu_kernel,
    to_kernel,
)
from kernels.quant.cpu_blocks import missing_isa
from tests.kernels.native import require_native_blocks
from tests.kernels.quant_ref import q8_activation_bound, random_blocks

pytestmark = pytest.mark.skipif(bool(missing_isa()), reason=f"this CPU lacks {missing_isa()}: the native block "
                                                            "kernels need x86 AVX2, FMA and F16C")


@pytest.fixture(autouse=True)
def _native_builds():
    require_native_blocks()  # the CPU has the ISA: a build failure fails every test here


@pytest.fixture(autouse=True)
def _native():
    set_cpu_kernel("native")
    yield
    set_cpu_kernel("auto")


def _f16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float16).view(np.uint16)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_repacked_exactly(kind: str) -> None:
    """Codes and the float16 block parameters come back bit for bit; the weight dequantizes to the file's values."""
    blocks = gguf_blocks.unpack(random_blocks(kind, 64, 256, seed=3), kind)
    w = to_kernel(from_gguf(blocks), "cpu")
    ref = torch.from_numpy(gguf_blocks.dequantize(blocks))
    if kind == "Q8_0":
        assert isinstance(w, Q8BlockWeight)
        assert torch.equal(w.codes, torch.from_numpy(blocks.codes))
        assert np.array_equal(w.d.numpy().view(np.uint16), _f16_bits(blocks.params["d"]))
        assert torch.equal(w.dequantize(), ref)
        return
    assert isinstance(w, Q4BlockWeight)
    assert torch.equal(w.codes(), torch.from_numpy(blocks.codes))
    # the packed bytes are the file's own nibble bytes (GGUF order: byte i = code i | code i + 16 << 4)
    raw_qs = random_blocks(kind, 64, 256, seed=3).reshape(64, 8, -1)[..., -16:].reshape(64, 128)
    assert np.array_equal(w.qs.numpy(), raw_qs)
    d = w.dm[:, 0].numpy().view(np.uint16)
    assert np.array_equal(d, _f16_bits(blocks.params["d"]))
    if kind == "Q4_1":  # m = zero - 8 d: the float32 detour may cost the last bits of a tiny m; values agree
        torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    else:
        assert torch.equal(w.dequantize(), ref)


def test_smollm_q4_1_and_q8_0_bits_exact(smollm_path: str) -> None:
    """The shipped file: its first Q4_1 tensor and the Q8_0 embedding keep every byte and float16 parameter."""
    reader = gguf.GGUFReader(smollm_path)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_1", "Q8_0") or kind in seen:
            continue
        seen.add(kind)
        raw = np.ascontiguousarray(t.data[:1024])
        blocks = gguf_blocks.unpack(raw, kind)
        w = to_kernel(from_gguf(blocks), "cpu")
        nb = blocks.codes.shape[1] // 32
        per_block = raw.reshape(raw.shape[0], nb, -1)
        if kind == "Q4_1":
            assert np.array_equal(w.qs.numpy(), per_block[..., 4:].reshape(raw.shape[0], -1))
            file_dm = per_block[..., :4].copy().view(np.uint16)  # [N, nb, 2]: d, m
            assert np.array_equal(w.dm.numpy().view(np.uint16), file_dm.transpose(0, 2, 1))
        else:
            assert np.array_equal(w.d.numpy().view(np.uint16), per_block[..., :2].copy().view(np.uint16)[..., 0])
            assert np.array_equal(w.codes.numpy().view(np.uint8), per_block[..., 2:].reshape(raw.shape[0], -1))
    assert seen == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (960, 576), (576, 1536), (40, 4096)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7])
def test_native_linear_within_activation_rounding(kind: str, n: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(n * 7 + k + m)
    w = to_kernel(quantize(torch.randn(n, k, generator=g) * 0.05, kind, 32 if kind == "int4" else 0), "cpu")
    assert isinstance(w, Q4BlockWeight if kind == "int4" else Q8BlockWeight)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # uneven block magnitudes
    y = w(x)
    ref = x @ w.dequantize().t()
    assert ((y - ref).abs() <= q8_activation_bound(x, w.dequantize())).all()
    # the worst-case bound grows with K; the typical error is what 8-bit activations give: < 1.5 % in norm
    assert (y - ref).norm() < 0.015 * ref.norm()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_native_linear_batch_and_thread_invariant(kind: str) -> None:
    """Each output row depends only on its own row of x: alone or among 7, on 1 thread or 2, the same bits."""
    g = torch.Generator().manual_seed(11)
    w = to_kernel(quantize(torch.randn(200, 576, generator=g) * 0.05, kind, 32 if kind == "int4" else 0), "cpu")
    x = torch.randn(7, 576, generator=g)
    batched = w(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([w(x[i : i + 1]) for i in range(7)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, alone)


def test_zero_rows_and_bf16_activations() -> None:
    g = torch.Generator().manual_seed(2)
    w = to_kernel(quantize(torch.randn(64, 128, generator=g) * 0.05, "int4", 32), "cpu")
    assert torch.equal(w(torch.zeros(2, 128)), torch.zeros(2, 64))
    x = torch.randn(3, 128, generator=g).bfloat16()
    y = w(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() @ w.dequantize().t()
    assert ((y.float() - ref).abs() <= q8_activation_bound(x.float(), w.dequantize()) + ref.abs() * 2**-8).all()


def test_shape_errors_are_loud() -> None:
    ops.load()
    qs = torch.zeros(4, 32, dtype=torch.uint8)
    dm = torch.zeros(4, 2, 2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="K of x"):
        ops.q4_linear(torch.zeros(1, 32), qs, dm)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.q4_linear(torch.zeros(1, 64, dtype=torch.float64), qs, dm)
    with pytest.raises(RuntimeError, match="dm must be"):
        ops.q4_linear(torch.zeros(1, 64), qs, torch.zeros(4, 2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q8_linear(torch.zeros(1, 48), torch.zeros(4, 48, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.half))
    with pytest.raises(ValueError, match="unknown quantization kernel"):
        set_cpu_kernel("fast")


def test_weights_that_do_not_fit_blocks_keep_torch_kernels() -> None:
    """K not a multiple of 32 (or a group that is not): torch's layouts, which take any even K."""
    from kernels.quant import Int8Weight

    w = to_kernel(quantize(torch.randn(8, 48), "int8", 0), "cpu")
    assert isinstance(w, Int8Weight)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_non_finite_activations_give_nan_outputs(kind: str) -> None:
    """A NaN or inf in a row of x makes that row's outputs NaN (not codes cast from garbage); other rows are
    untouched."""
    g = torch.Generator().manual_seed(4)
    w = to_kernel(quantize(torch.randn(32, 64, generator=g) * 0.05, kind, 32 if kind == "int4" else 0), "cpu")
    x = torch.randn(3, 64, generator=g)
    clean = w(x)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    y = w(x)
    assert y[:2].isnan().all() and torch.equal(y[2], clean[2])
