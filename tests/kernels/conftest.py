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


@pytest.fixture
def bf16_gemm(request):
    """Forces the bf16 key-block kernel named by the (indirect) parameter for one test; skips where the CPU
    lacks its instructions (AMX tiles for brgemm); back to auto afterwards. The extension itself must build: a
    build or load failure fails the test."""
    from kernels.cpu import ops

    mode = getattr(request, "param", "auto")
    ops.load()
    try:
        ops.bf16_attn_gemm(mode)
    except RuntimeError as e:
        pytest.skip(f"this CPU lacks the instructions of bf16_attn_gemm({mode!r}): {e}".splitlines()[0])
    yield mode
    ops.bf16_attn_gemm("auto")


@pytest.fixture(scope="module")
def native_kernels():
    """kernels/cpu built and loaded for a module's tests (the toolchain is part of the test machine: a build failure
    fails them); the ISA variant a test forced is back to auto afterwards."""
    from kernels.cpu import build, ops

    try:
        build.load()
    except Exception as e:  # noqa: BLE001 - any build or load failure is a failure
        pytest.fail(f"kernels/cpu must build here: {e}")
    yield
    ops.cpu_isa("auto")
