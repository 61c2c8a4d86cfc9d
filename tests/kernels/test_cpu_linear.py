"""The float32 panel linear (kernels/cpu/linear.cpp) against torch's float32 matmul over a grid of shapes.

Tolerance: float32 sums in another order than MKL's, so within 1e-5 relative (and absolute, for outputs near 0).
Batch invariance is exact: a row's output does not depend on the other rows of the call."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops

ops.load()


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 96, 97, 300])  # the 6-row tile, its remainders, the 96-row blocks
@pytest.mark.parametrize(("n", "k"), [(16, 1), (48, 8), (960, 576), (576, 1536)])
def test_linear_panels_matches_matmul(m, n, k) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g)
    p = ops.pack_panels(w)
    assert p.shape == (n // 16, k, 16) and torch.equal(ops.unpack_panels(p), w)
    y = ops.linear_panels(x, p)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, x.double().matmul(w.double().T).float(), rtol=1e-5, atol=1e-5)


def test_linear_panels_rows_are_batch_invariant() -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(960, 576, generator=g), torch.randn(37, 576, generator=g)
    p = ops.pack_panels(w)
    full = ops.linear_panels(x, p)
    for i in (0, 5, 6, 36):
        assert torch.equal(ops.linear_panels(x[i : i + 1], p), full[i : i + 1])
    assert torch.equal(ops.linear_panels(x[7:20], p), full[7:20])  # a block of rows at another tile offset


def test_linear_panels_rejects_bad_inputs() -> None:
    p = ops.pack_panels(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="K of x"):
        ops.linear_panels(torch.randn(2, 9), p)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear_panels(torch.randn(2, 8, dtype=torch.bfloat16), p)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.pack_panels(torch.randn(20, 8))


def test_linear_panels_compiles_as_an_opaque_op() -> None:
    p = ops.pack_panels(torch.randn(64, 32))
    x = torch.randn(4, 32)
    fn = torch.compile(lambda a: ops.linear_panels(a, p) * 2, fullgraph=True, dynamic=False)
    torch.testing.assert_close(fn(x), ops.linear_panels(x, p) * 2)


def test_pack_dense_panels_replaces_float32_linears_and_keeps_a_tied_table() -> None:
    from kernels.quant import PanelWeight, linear, pack_dense_panels

    g = torch.Generator().manual_seed(5)

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Parameter(torch.randn(64, 32, generator=g), requires_grad=False)
            self.lm_head = self.embed  # tied, as SmolLM2's
            self.w_o = torch.nn.Parameter(torch.randn(48, 32, generator=g), requires_grad=False)
            self.w_odd = torch.nn.Parameter(torch.randn(40, 32, generator=g), requires_grad=False)  # N % 16 != 0
            self.w_bf16 = torch.nn.Parameter(torch.randn(32, 32, generator=g).bfloat16(), requires_grad=False)

    toy = Toy()
    x = torch.randn(5, 32, generator=g)
    want = {n: linear(x, getattr(toy, n)) for n in ("lm_head", "w_o", "w_odd")}
    assert pack_dense_panels(toy, ("lm_head", "w_o", "w_odd", "w_bf16")) == 2
    assert isinstance(toy.lm_head, PanelWeight) and isinstance(toy.w_o, PanelWeight)
    assert isinstance(toy.embed, torch.nn.Parameter) and toy.embed.shape == (64, 32)  # the table stays
    assert isinstance(toy.w_odd, torch.nn.Parameter) and toy.w_bf16.dtype == torch.bfloat16
    for n, y in want.items():
        torch.testing.assert_close(linear(x, getattr(toy, n)), y, rtol=1e-5, atol=1e-5)
    assert torch.equal(toy.lm_head.dequantize(), toy.embed)
    assert "panels" in dict(toy.w_o.named_buffers())  # a buffer: compiled forwards see module state
