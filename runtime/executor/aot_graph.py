"""Decode graphs as AOTInductor packages: compiled once (torch.export + aoti_compile_and_package), kept in the
artifact cache (runtime/executor/artifact_cache.py) and loaded by any later process with the same key.

A package holds the whole decode forward `forward(ids[B], pos[B], logit_idx[B]) -> logits[B, V]` for one group
of buckets: B is a dynamic dimension over the group's range, so one graph serves each of its buckets. Groups are
cut where the model's own code takes another path by row count (a quantized linear switches from its kernel to
the kept dense copy at `dense_min_rows` rows), so no graph guards on B: with the default thresholds the CPU
buckets 1,2,4 | 8,16,32 are two graphs. Attention is the opaque custom op `radixgen_rt::attention(...,
backend_id)` (runtime/models/attn_op.py; the loading process registers its backend at the same index, so the op
resolves to that process's backend over its own KV pool).

Weights, per group (`weights_mode`):
- "bound" (every linear runs its quantized kernel): compiled without freezing and with its constants outside the
  shared library, so each constant keeps its original name (`model.layers.0.w_qkv.qs`, ...) and a loading process
  binds its own live model tensors to them (runtime/executor/graph_package.py `bind_constants`, no copy) after
  checking them against the table of constants the library expects (name, dtype, shape, stride). ~2 MB on disk.
- "embedded" (the group multiplies dense float weights): frozen, the weights prepacked into the library for the
  GEMM (1.7x faster at 32 rows than unfrozen on SmolLM2's dense copies), one copy for the whole group.
The cache keeps only the package's shared library (`graph.so`) and, for bound groups, the constants table.
Figures: bench/results/startup.md.

The cache key names everything the generated code depends on: the model file's identity, dtype, quantization
and its kernel, KV dtype, attention backend and its registry index, this package's own source hash, the torch
version, the CPU's flags and the buckets it serves. Anything else that changes the graph changes one of these.
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
FORMAT = "aoti-decode-shared-2"  # entry layout: the library of a dynamic-batch group (+ its constants table)
# weights "bound": the live model's tensors handed over at load; "embedded": frozen and prepacked into the library
INDUCTOR_CONFIGS = {"bound": {"freezing": False, "aot_inductor.package_constants_in_so": False},
                    "embedded": {"freezing": True}}


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


def graph_key(base: dict[str, Any], group: tuple[int, ...], weights: str) -> dict[str, Any]:
    return {**base, "bucket": list(group), "weights": weights}


def weights_mode(model: torch.nn.Module, group: tuple[int, ...]) -> str:
    """"embedded" when the group's rows multiply dense float weights (a model without quantized linears, or
    quantized linears past their `dense_min_rows`): freezing prepacks those for the GEMM (measured 1.7x faster at
    32 rows on SmolLM2's dense copies); "bound" when every linear runs its quantized kernel on its own buffers,
    which freezing leaves as they are."""
    from kernels.quant.weights import QuantWeight

    quant = [m for m in model.modules() if isinstance(m, QuantWeight)]
    if not quant:
        return "embedded"
    dense = any(m.dense_copies and m.dense is not None and group[0] >= m.dense_min_rows for m in quant)
    return "embedded" if dense else "bound"


def row_thresholds(model: torch.nn.Module) -> set[int]:
    """Row counts at which the model's forward takes another path: each quantized linear's `dense_min_rows`
    (from there on one dense GEMM, kernels/quant/weights.py), each int8 linear's `min_rows` when it has a kernel
    for fewer rows and its `int_mm_rows` where it switches op there (kernels/quant/w8a8.py). A group spanning one
    of these would not export: its graph would guard on the batch size."""
    from kernels.quant.w8a8 import W8A8Weight
    from kernels.quant.weights import QuantWeight

    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, QuantWeight) and m.dense_copies:
            out.add(int(m.dense_min_rows))
        if isinstance(m, W8A8Weight) and m.small is not None:
            out.add(m.min_rows)
        if isinstance(m, W8A8Weight) and m.kernel == "native" and m.int_mm_rows is not None:
            out.add(m.int_mm_rows)
    return out


def bucket_groups(buckets: tuple[int, ...], thresholds: set[int]) -> list[tuple[int, ...]]:
    """The buckets cut into runs that no threshold separates (one compiled graph each), smallest first."""
    groups: list[list[int]] = []
    for bs in sorted(buckets):
        if groups and not any(groups[-1][-1] < t <= bs for t in thresholds):
            groups[-1].append(bs)
        else:
            groups.append([bs])
    return [tuple(g) for g in groups]


def key_base(model_path: str, dtype: str, quantization: str, quantization_kernel: str, kv_dtype: str,
             attention_backend: str, backend_id: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every key field except the bucket."""
    return {"format": FORMAT, "model": file_identity(model_path), "dtype": dtype,
            "quantization": quantization, "quantization_kernel": quantization_kernel, "kv_dtype": kv_dtype,
            "attention_backend": attention_backend, "backend_id": backend_id, "code": code_hash(),
            "torch": torch.__version__, "cpu": cpu_flags(), **(extra or {})}


def compile_package(runner: DecodeGraphRunner, group: tuple[int, ...], out: Path,
                    weights: str) -> tuple[float, list[Any] | None]:
    """Export the runner's decode body over the rows of `group` (dynamic when it has several buckets), compile it
    with AOTInductor, weights `weights` (weights_mode), and write the package's shared library to `out` (and its
    custom-op call table beside it); returns the seconds it took and, for bound weights, the constants table the
    library expects (graph_package.constants_table)."""
    t = time.perf_counter()
    fn, args = runner.prepare_bucket(group[-1])
    shapes = None
    if len(group) > 1:
        rows = torch.export.Dim("rows", min=group[0], max=group[-1])
        shapes = {"ids": {0: rows}, "pos": {0: rows}, "logit_idx": {0: rows}}
    pt2 = out.with_suffix(".pt2")
    with torch.no_grad():
        ep = torch.export.export(fn, args, strict=False, dynamic_shapes=shapes)
        torch._inductor.aoti_compile_and_package(ep, package_path=str(pt2),
                                                  inductor_configs=INDUCTOR_CONFIGS[weights])
    graph_package.extract_library(pt2, out)
    pt2.unlink()
    table = graph_package.constants_table(graph_package.load_library(out), fn) if weights == "bound" else None
    return time.perf_counter() - t, table
