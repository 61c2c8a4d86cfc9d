"""The one rule for tests of the native CPU kernels (kernels/cpu): skip only where this CPU lacks the
instruction set they need, and say so; where it has it, a build or load failure fails the test."""

from __future__ import annotations

import pytest

from kernels.quant.cpu_blocks import missing_isa, native_unavailable_reason


def require_native_blocks() -> None:
    """For tests of the native block kernels (x86 AVX2, FMA, F16C)."""
    missing = missing_isa()
    if missing:
        pytest.skip(f"this CPU lacks {missing}: the native block kernels need x86 AVX2, FMA and F16C")
    reason = native_unavailable_reason()
    if reason:
        pytest.fail(f"the native block kernels must run on this CPU (it has AVX2, FMA and F16C): {reason}")
