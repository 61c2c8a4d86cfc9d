"""Parameters of the native CPU attention tests."""

from __future__ import annotations

import pytest
import torch

# (dtype, bf16 key-block kernel) pairs for the native CPU attention tests: float32 once, bfloat16 under each
# kernel kernels.cpu.ops.bf16_attn_gemm can force (brgemm only where oneDNN has AMX tiles; "dot" is the
# AVX-512-BF16 kernel where the CPU has it, its portable twin elsewhere).
# torch.float16 stands for a float16 KV pool under float32 q and outputs (--kv-cache-dtype float16): tests take q's
# dtype from Q_DTYPE.
DTYPE_GEMMS = [
    pytest.param(torch.float32, "auto", id="f32"),
    *(pytest.param(torch.bfloat16, m, id=f"bf16-{m}") for m in ("f32", "dot", "brgemm")),
    pytest.param(torch.float16, "auto", id="f32-f16kv"),
]


Q_DTYPE = {torch.float16: torch.float32}
