"""Decode graphs as AOTInductor packages: compiled once (torch.export + aoti_compile_and_package), kept in the
artifact cache (runtime/executor/artifact_cache.py) and loaded by any later process with the same key.

A package holds one bucket's whole decode forward `forward(ids[B], pos[B], logit_idx[B]) -> logits[B, V]` with
the weights embedded as constants (inductor freezing: linears prepacked), attention as the opaque custom op
`radixgen_rt::attention(..., backend_id)` (runtime/models/attn_op.py; the loading process registers its
backend at the same index, so the op resolves to that process's backend over its own KV pool). The cache keeps
only the package's shared library (`graph.so`, the generated code with the constants in its data section): a
later process verifies it and loads it in place (`AOTIModelContainerRunnerCpu`), with no compiler and no copy
of the package unpacked per start. Replay passes the runner's static buffers, as the JIT graphs do.

The cache key names everything the generated code depends on: the model file's identity, dtype, quantization
and its kernel, KV dtype, attention backend and its registry index, this package's own source hash, the torch
version, the CPU's flags and the bucket. Anything else that changes the graph changes one of these.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.executor import graph_package

if TYPE_CHECKING:
    from runtime.executor.cuda_graph import DecodeGraphRunner

# Source trees whose code ends up in (or decides) a decode graph, less the files that only find, store and load
# the compiled graphs (their on-disk layout is named by the key's "format" instead).
_CODE_DIRS = ("runtime/models", "runtime/executor", "kernels")
_NOT_IN_GRAPH = frozenset({"runtime/executor/artifact_cache.py", "runtime/executor/compile_manager.py",
                           "runtime/executor/compile_worker.py", "runtime/executor/graph_package.py"})
_ROOT = Path(__file__).resolve().parents[2]
FORMAT = "aoti-decode-so-1"  # entry layout: the package's shared library alone


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """sha256 over the sources of the model, executor and kernels packages (paths and contents)."""
    h = hashlib.sha256()
    for d in _CODE_DIRS:
        for p in sorted((_ROOT / d).rglob("*")):
            rel = p.relative_to(_ROOT).as_posix()
            if p.suffix in (".py", ".cpp", ".h", ".c") and p.is_file() and rel not in _NOT_IN_GRAPH:
                h.update(rel.encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU model and a hash of its feature flags (generated code is specialised to the ISA)."""
    model, flags = platform.processor(), ""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return f"{model}|{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def file_identity(path: str) -> dict[str, Any]:
    """A model file (or directory: its files) named by path, size, mtime and a hash of its first and last MiB."""
    p = Path(path).resolve()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    size = 0
    for f in files:
        st = f.stat()
        size += st.st_size
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if st.st_size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read(1 << 20))
    return {"path": str(p), "bytes": size, "sha256_ends": h.hexdigest()[:24]}


def graph_key(base: dict[str, Any], bucket: int) -> dict[str, Any]:
    return {**base, "bucket": bucket}


def key_base(model_path: str, dtype: str, quantization: str, quantization_kernel: str, kv_dtype: str,
             attention_backend: str, backend_id: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every key field except the bucket."""
    return {"format": FORMAT, "model": file_identity(model_path), "dtype": dtype,
            "quantization": quantization, "quantization_kernel": quantization_kernel, "kv_dtype": kv_dtype,
            "attention_backend": attention_backend, "backend_id": backend_id, "code": code_hash(),
            "torch": torch.__version__, "cpu": cpu_flags(), **(extra or {})}


def compile_package(runner: DecodeGraphRunner, bucket: int, out: Path) -> float:
    """Export the runner's decode body at `bucket` rows, compile it with AOTInductor and write the package's
    shared library to `out`; returns the seconds it took."""
    t = time.perf_counter()
    fn, args = runner.prepare_bucket(bucket)
    pt2 = out.with_suffix(".pt2")
    with torch.no_grad():
        ep = torch.export.export(fn, args, strict=False)
        torch._inductor.aoti_compile_and_package(ep, package_path=str(pt2), inductor_configs={"freezing": True})
    graph_package.extract_library(pt2, out)
    pt2.unlink()
    return time.perf_counter() - t
