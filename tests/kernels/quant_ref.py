"""Shared by the quantization tests: random GGUF block bytes and the int8-activation error bound."""

from __future__ import annotations

import numpy as np
import torch

from kernels.quant import gguf_blocks


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random raw block bytes [n, row_bytes] with finite, moderate f16 scales."""
    rng = np.random.default_rng(seed)
    nb = k // gguf_blocks.BLOCK_WEIGHTS[kind]
    raw = rng.integers(0, 256, size=(n, nb, gguf_blocks.BLOCK_BYTES[kind]), dtype=np.uint8)
    n_f16 = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 1, "Q4_K": 2}[kind]
    scales = (rng.standard_normal((n, nb, n_f16)) * 0.02).astype(np.float16)
    raw[..., : 2 * n_f16] = scales.view(np.uint8).reshape(n, nb, 2 * n_f16)
    return raw.reshape(n, -1)


def q8_activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on |x @ w^T - y| for a kernel that rounds x [M, K] to int8 per block of 32 (w [N, K])."""
    m, k = x.shape
    xs = x.float().abs().reshape(m, k // 32, 32).amax(-1) / 254  # half a step per element
    wsum = w.abs().reshape(w.shape[0], k // 32, 32).sum(-1)
    return xs @ wsum.t() + 1e-5 * (x.float().abs() @ w.abs().t()) + 1e-6
