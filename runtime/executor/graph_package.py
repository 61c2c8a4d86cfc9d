"""A compiled decode graph on disk and in memory: the shared library of an AOTInductor package.

An AOTInductor package (.pt2) is a zip holding the generated C++, its build metadata and one shared library,
which carries the whole forward and (with constants in the library, the default) the frozen weights in its
data section. A loaded graph needs only that library: `extract_library` keeps it when a bucket is compiled,
`load_library` opens it in place with AOTInductor's CPU container runner (dlopen, no compiler), and
`PackagedGraph` replays it over the decode runner's static buffers.

Loading in place matters at start-up: `aoti_load_package` unpacks every package into a new directory under
/tmp on each load (~126 MB per SmolLM2 bucket, more for buckets with dense weight copies) and leaves it there
when the process is killed. The caller verifies the file (runtime/executor/artifact_cache.py) before loading it.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from runtime.executor.cuda_graph import Forward


def extract_library(pt2: Path, out: Path) -> None:
    """Copy the package's one shared library to `out` and, when the graph calls custom ops, its call table
    (the .json AOTInductor's runner reads beside the library) to `out` with suffix .json; a package without
    exactly one library is refused."""
    with zipfile.ZipFile(pt2) as z:
        libs = [n for n in z.namelist() if n.endswith(".so")]
        if len(libs) != 1:
            raise ValueError(f"{pt2}: expected one shared library in the package, found {libs}")
        table = libs[0][: -len(".so")] + ".json"
        pairs = [(libs[0], out)] + ([(table, out.with_suffix(".json"))] if table in z.namelist() else [])
        for name, dest in pairs:
            with z.open(name) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)


def load_library(path: Path) -> Any:
    """The AOTInductor model in `path` (one model instance: the decode loop runs one step at a time); its
    custom-op call table, if any, is read from `path` with suffix .json."""
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)


class PackagedGraph:
    """A `Graph` replaying a loaded compiled decode graph over the runner's static buffers."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.args: list[torch.Tensor] = []

    def capture(self, fn: Forward, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.args = list(args)  # views of the static buffers: the same tensors on every replay
        return self.replay()

    def replay(self) -> torch.Tensor:
        out: torch.Tensor = self.module.run(self.args)[0]
        return out
