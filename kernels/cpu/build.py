"""Builds and loads the native CPU ops (kernels/cpu/attention.cpp, elementwise.cpp) on first use, JIT.

The extension is compiled on the machine that runs it, with `-O3 -march=native`, by
`torch.utils.cpp_extension.load` (g++ and ninja), into a cache directory keyed by a hash of the source, torch's
version and this CPU's feature flags: ~/.cache/radixgen/kernels/<key>/ (override with the `cache_dir`
argument). The first use on a machine pays one compile (about a minute on 2 cores); every later process,
including server subprocesses and the rest of a test session, loads the cached shared library directly.
Nothing here runs at `import kernels`: only `load()` compiles, and only the native backend calls it.
Loading registers the `torch.ops.radixgen.*` ops (see kernels/cpu/ops.py for their contracts).
"""

from __future__ import annotations

import hashlib
import platform
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attention.cpp")
SOURCES = [SOURCE, SOURCE.with_name("elementwise.cpp"), SOURCE.with_name("linear.cpp"),
           SOURCE.with_name("quant_gemv.cpp")]  # one extension: every op
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-DNDEBUG"]
DEFAULT_CACHE = Path.home() / ".cache" / "radixgen" / "kernels"

_lock = threading.Lock()
_loaded: Path | None = None


def cpu_flags() -> str:
    """The CPU feature flags line of /proc/cpuinfo (x86 'flags', arm 'Features'), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def build_key() -> str:
    h = hashlib.sha256()
    sources = [f.read_bytes() for f in sorted(SOURCE.parent.glob("*.[ch]*")) if f.suffix in (".cpp", ".h")]
    for part in (*sources, torch.__version__.encode(), cpu_flags().encode(), " ".join(CFLAGS).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


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
        name = f"radixgen_cpu_attn_{key}"
        build_dir = (cache_dir or DEFAULT_CACHE) / key
        lib = build_dir / f"{name}.so"
        ready = build_dir / "ready"  # written after a complete build: a half-linked .so is never loaded
        if ready.exists():
            torch.ops.load_library(str(lib))
        else:
            from torch.utils import cpp_extension

            build_dir.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name=name, sources=[str(f) for f in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), is_python_module=False, verbose=verbose,
            )  # compiles under a file lock shared with concurrent builders (a no-op if one finished), loads
            ready.touch()
        _loaded = lib
        return lib


if __name__ == "__main__":  # `python -m kernels.cpu.build`: compile ahead of time (make setup does)
    print(load(verbose=True))
