"""The machine a benchmark ran on, in one line for its results file: CPU model, vCPUs and the instruction-set
flags radixgen's kernel choices depend on (AVX2, AVX-512, VNNI, native bf16, AMX)."""

from __future__ import annotations

import os
import platform

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo value of `key` ("" when absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), "")
    except OSError:
        return ""


def describe() -> str:
    """e.g. 'Intel(R) Xeon(R) Processor @ 2.80GHz, 2 vCPUs (avx2, fma, f16c, avx512f)'."""
    name = cpuinfo("model name") or platform.processor() or platform.machine()
    flags = set(cpuinfo("flags").split())
    isa = ", ".join(f for f in ISA_FLAGS if f in flags) or "none of " + "/".join(ISA_FLAGS)
    return f"{name}, {os.cpu_count()} vCPUs ({isa})"
