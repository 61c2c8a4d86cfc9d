"""Builds and loads the native CPU ops (kernels/cpu/*.cpp) on first use, JIT, one variant per instruction set.

Layout (kernels/cpu/isa.h): each op-family source is compiled once per ISA variant this CPU can run, with that
variant's -m flags and -DRADIXGEN_ISA=<variant>, into namespace radixgen_cpu::<variant>; dispatch.cpp, compiled
once with the baseline flags, registers the `torch.ops.radixgen.*` ops and picks a variant at start-up (the best
the CPU runs; `radixgen::cpu_isa` forces another). Variants (x86-64; other machines build `portable` only):
  avx512   : -march=x86-64-v4 (AVX-512 F/BW/DQ/VL), plus -mavx512bf16 / -mavx512vnni where the CPU has them
  avx2     : -march=x86-64-v3 (AVX2, FMA, F16C)
  portable : the baseline ISA (-march=x86-64): the plain-C++ twin
The best variant is compiled with -march=native instead (every extension this CPU has, as before the split).
Only variants the CPU runs are built, so no inline function compiled for instructions it lacks can reach it.

The library is built with g++ and ninja into a cache directory keyed by a hash of the sources, torch's version,
this CPU's feature flags and the flags below: ~/.cache/radixgen/kernels/<key>/ (override with `cache_dir`). The
first use on a machine pays one compile (a few minutes on 2 cores); every later process, including server
subprocesses and the rest of a test session, loads the cached shared library directly. Nothing here runs at
`import kernels`: only `load()` compiles, and only the native backend calls it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).parent
# Compiled once per ISA variant (each an op family, plus the variant's table of entry points).
ISA_SOURCES = ("attention_decode.cpp", "attention_extend.cpp", "linear.cpp", "quant_gemv.cpp", "w8a8_linear.cpp",
               "w8a8_int_mm.cpp", "elementwise.cpp", "isa_table.cpp")
DISPATCH_SOURCE = "dispatch.cpp"  # compiled once, baseline flags
CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-fPIC", "-std=c++20"]
DEFAULT_CACHE = Path.home() / ".cache" / "radixgen" / "kernels"

_lock = threading.Lock()
_loaded: Path | None = None


class Variant(NamedTuple):
    name: str
    needs: frozenset[str]  # /proc/cpuinfo flags the variant's instructions need
    march: str  # its instruction-set level (the best variant takes -march=native instead)
    extras: tuple[tuple[str, str], ...]  # (cpu flag, -m option) added where the CPU has the flag


X86_VARIANTS = (
    Variant("avx512", frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"}),
            "x86-64-v4", (("avx512_bf16", "-mavx512bf16"), ("avx512_vnni", "-mavx512vnni"))),
    Variant("avx2", frozenset({"avx2", "fma", "f16c"}), "x86-64-v3", ()),
    Variant("portable", frozenset(), "x86-64", ()),
)


def cpu_flags() -> str:
    """The CPU feature flags line of /proc/cpuinfo (x86 'flags', arm 'Features'), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def variant_flags(flags: str | None = None) -> dict[str, list[str]]:
    """The ISA variants this CPU runs, best first, each with its compiler flags."""
    have = set((cpu_flags() if flags is None else flags).split())
    if platform.machine() not in ("x86_64", "AMD64", "i686"):
        return {"portable": ["-march=native"]}
    out: dict[str, list[str]] = {}
    for v in X86_VARIANTS:
        if not v.needs <= have:
            continue
        best = not out
        opts = ["-march=native"] if best else [f"-march={v.march}", "-mtune=native"]
        if not best:
            opts += [opt for flag, opt in v.extras if flag in have]
        if v.name == "avx512":
            opts.append("-mprefer-vector-width=512")
        out[v.name] = opts
    return out


def isas() -> list[str]:
    """The variants load() builds on this CPU, best first (never builds)."""
    return list(variant_flags())


def _sources() -> list[Path]:
    return sorted(f for f in HERE.iterdir() if f.suffix in (".cpp", ".h"))


def build_key() -> str:
    h = hashlib.sha256()
    parts = [f.name.encode() + f.read_bytes() for f in _sources()]
    parts += [torch.__version__.encode(), cpu_flags().encode(), " ".join(CFLAGS).encode(),
              repr(sorted(variant_flags().items())).encode()]
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _ninja_file(lib: str, variants: dict[str, list[str]]) -> str:
    """build.ninja: every (variant, source) object, the dispatch object, one shared library."""
    from torch.utils import cpp_extension

    inc = " ".join(f"-isystem {p}" for p in cpp_extension.include_paths())
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    libs = " ".join(f"-L{p}" for p in cpp_extension.library_paths())
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {os.environ.get('CXX') or 'c++'}",  # the compiler named by CXX, as torch's extension builds do
        f"cflags = {' '.join(CFLAGS)} {abi} -I{HERE} {inc}",
        f"ldflags = -shared -fopenmp {libs} -lc10 -ltorch_cpu -ltorch",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cflags $isa_flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
    ]
    objs = []
    for name, opts in variants.items():
        for src in ISA_SOURCES:
            obj = f"{name}/{Path(src).stem}.o"
            objs.append(obj)
            lines += [f"build {obj}: cxx {HERE / src}", f"  isa_flags = -DRADIXGEN_ISA={name} {' '.join(opts)}"]
    have = " ".join(f"-DRADIXGEN_HAVE_{n.upper()}=1" for n in variants if n != "portable")
    lines += [f"build dispatch.o: cxx {HERE / DISPATCH_SOURCE}", f"  isa_flags = {have}"]
    lines += [f"build {lib}: link {' '.join(objs)} dispatch.o", f"default {lib}"]
    return "\n".join(lines) + "\n"


def _compile(build_dir: Path, lib: str, verbose: bool) -> None:
    ninja = shutil.which("ninja")
    if ninja is None:
        raise RuntimeError("building kernels/cpu needs ninja (and g++) on PATH")
    (build_dir / "build.ninja").write_text(_ninja_file(lib, variant_flags()))
    res = subprocess.run([ninja, "-C", str(build_dir)] + (["-v"] if verbose else []), capture_output=not verbose,
                         text=True)
    if res.returncode != 0:
        tail = (res.stdout or "")[-4000:] if not verbose else ""
        raise RuntimeError(f"Error building extension 'radixgen_cpu' in {build_dir}:\n{tail}")


def is_loaded() -> bool:
    """Whether load() has already put the ops into this process (never builds)."""
    return _loaded is not None


def load(cache_dir: Path | None = None, verbose: bool = False) -> Path:
    """Compile (once per machine) and load the ops into this process; returns the shared library's path.

    Raises whatever the compiler or loader raised: callers that auto-selected the backend catch it.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        key = build_key()
        build_dir = (cache_dir or DEFAULT_CACHE) / key
        name = f"radixgen_cpu_{key}.so"
        lib = build_dir / name
        ready = build_dir / "ready"  # written after a complete build: a half-linked .so is never loaded
        if not ready.exists():
            build_dir.mkdir(parents=True, exist_ok=True)
            with open(build_dir / "lock", "w") as lock:  # one builder per key across processes
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not ready.exists():
                    _compile(build_dir, name, verbose)
                    ready.touch()
        torch.ops.load_library(str(lib))
        _loaded = lib
        return lib


if __name__ == "__main__":  # `python -m kernels.cpu.build`: compile ahead of time (make setup does)
    print(load(verbose=True))
