"""kernels.quant.to_kernel(..., exact=True): a GGUF Q8_0 weight whose rows mix blocks of very different scales
(a tied 262k-vocabulary head) keeps its block scales on every CPU kernel choice, and a weight marked
`dense_copies = False` gets no dense copy and no per-call dequantization of the whole table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.quant import Int8Weight, Q8BlockWeight, QTensor, keep_dense_copies, set_cpu_kernel, to_kernel
from kernels.quant.cpu_blocks import native_available


def _mixed_blocks(n: int = 96, k: int = 128) -> QTensor:
    """Q8_0-like codes whose block scales span 300x within a row (one outlier block per row)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int64).to(torch.int8)
    d = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    d[:, 0] *= 300
    return QTensor("int8", codes, d.half().float(), origin="Q8_0")  # float16 block scales, as GGUF stores them


@pytest.fixture
def kernel_mode():
    yield set_cpu_kernel
    set_cpu_kernel("auto")


def test_torch_kernel_keeps_block_scales_as_two_terms(kernel_mode):
    kernel_mode("torch")
    q = _mixed_blocks()
    want = q.dequantize()
    exact, plain = to_kernel(q, "cpu", exact=True), to_kernel(q, "cpu")
    assert isinstance(exact, Int8Weight) and exact.codes2 is not None
    step = want.abs().amax(dim=1, keepdim=True) / 127  # one per-channel step
    err_exact = ((exact.dequantize() - want).abs() / step).max().item()
    err_plain = ((plain.dequantize() - want).abs() / step).max().item()
    assert err_exact <= 1 / 200 and err_plain >= 0.25, (err_exact, err_plain)
    x = torch.randn(3, q.shape[1], generator=torch.Generator().manual_seed(1))
    y, ref = exact(x), x @ want.t()
    # bfloat16 activations and outputs: 2^-8 of the row's magnitude
    assert ((y - ref).abs().max() / ref.abs().max()).item() <= 1e-2


@pytest.mark.skipif(not native_available(), reason="the native q8 kernel does not run on this CPU")
def test_auto_keeps_q8_codes_on_the_native_kernel(kernel_mode):
    kernel_mode("auto")
    q = _mixed_blocks()
    w = to_kernel(q, "cpu", exact=True)
    assert isinstance(w, Q8BlockWeight)
    assert torch.equal(w.codes, q.codes) and torch.equal(w.dequantize(), q.dequantize())


def test_no_dense_copy_when_marked(kernel_mode):
    kernel_mode("torch")
    w = to_kernel(_mixed_blocks(), "cpu", exact=True)
    w.dense_copies = False
    assert keep_dense_copies(torch.nn.ModuleList([w]), 1, torch.float32) == 0 and w.dense is None
    w.dense_min_rows = 1  # many rows: still the int8 kernel, never the whole table in float
    calls = []
    w.dense_weight = lambda dtype: calls.append(dtype)  # type: ignore[method-assign]
    x = torch.randn(300, w.in_features)
    np.testing.assert_allclose(w(x).numpy(), (x @ w.dequantize().t()).numpy(), rtol=0, atol=0.05 * float(
        (x @ w.dequantize().t()).abs().max()))
    assert not calls
