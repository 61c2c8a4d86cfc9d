"""Kernel tests run the Triton kernels under the interpreter on CPU-only machines.

TRITON_INTERPRET is read when a kernel is decorated (at import of kernels.triton.*), so it is set here,
before any test module imports them. With CUDA present the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


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


@pytest.fixture
def bf16_gemm(request):
    """Forces the bf16 key-block kernel named by the (indirect) parameter for one test; skips where the CPU
    lacks it; back to auto afterwards."""
    from kernels.cpu import ops

    mode = getattr(request, "param", "auto")
    try:
        ops.bf16_attn_gemm(mode)
    except RuntimeError as e:
        pytest.skip(f"bf16_attn_gemm({mode!r}): {e}".splitlines()[0])
    yield mode
    ops.bf16_attn_gemm("auto")
