"""A small smoothed W8A8 weight with float input channels, shared by the int8 op tests."""

from __future__ import annotations

import torch

from kernels.quant.w8a8 import W8A8Weight


def smoothed_weight(seed: int, rows: int) -> tuple[W8A8Weight, torch.Tensor]:
    """A 100 x 74 weight calibrated on `rows` rows of input with two outlier channels (3 and 60), smoothed at alpha
    0.5 with 2 float channels, on the native kernel; returns it and that input [rows, 74]."""
    g = torch.Generator().manual_seed(seed)
    n, k = 100, 74
    wf = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g) * 2
    x[:, [3, 60]] *= 50
    w = W8A8Weight(wf, None, 1)
    w.observe(True)
    w(x)
    w.observe(False)
    w.smooth(wf, 0.5, float_channels=2)
    assert w.fidx is not None and w.wf is not None and w.inv_s is not None
    w.set_kernel("native")
    return w, x
