"""A compiled decode graph on disk and in memory: the shared library of an AOTInductor package.

An AOTInductor package (.pt2) is a zip holding the generated C++, its build metadata and one shared library,
which carries the whole forward. Compiled with its constants outside the library (runtime/executor/aot_graph.py),
the library names each weight it reads by the model's own attribute path; a loaded graph needs only the library
and the live model: `extract_library` keeps the library when a group is compiled, `load_library` opens it in
place with AOTInductor's CPU container runner (dlopen, no compiler), `bind_constants` hands it the model's own
tensors (no copy: the graph and the eager forward share one set of weights), and `PackagedGraph` replays it over
the decode runner's static buffers.

Binding is checked: `constants_table` records, when the graph is compiled, each constant's name, attribute path,
the library's dtype code and the tensor's dtype, shape and stride; a loading process binds only when its own
tensors match that table entry for entry (a graph reads its constants by raw pointer, so a tensor of another
shape or layout must never reach it).

Loading in place matters at start-up: `aoti_load_package` unpacks every package into a new directory under
/tmp on each load (~126 MB per SmolLM2 bucket, more for buckets with dense weight copies) and leaves it there
when the process is killed. The caller verifies the file (runtime/executor/artifact_cache.py) before loading it.
"""

from __future__ import annotations

import functools
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


def _resolve(root: torch.nn.Module, fqn: str) -> torch.Tensor:
    t = functools.reduce(getattr, fqn.split("."), root)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"graph constant {fqn} is not a tensor of the live model ({type(t).__name__})")
    return t


def constants_table(module: Any, root: torch.nn.Module) -> list[list[Any]]:
    """[name, attribute path under `root`, library dtype code, dtype, shape, stride] for each constant the loaded
    library `module` reads, from `root`'s tensors (the module the graph was exported from)."""
    fqns: dict[str, str] = module.get_constant_names_to_original_fqns()
    codes: dict[str, int] = module.get_constant_names_to_dtypes()
    table: list[list[Any]] = []
    for name in sorted(fqns):
        t = _resolve(root, fqns[name])
        table.append([name, fqns[name], codes[name], str(t.dtype), list(t.shape), list(t.stride())])
    return table


def bind_constants(module: Any, root: torch.nn.Module, table: list[list[Any]]) -> None:
    """Hand the loaded library `module` the live tensors of `root` as its constants (no copy), after checking
    that the library's constants and `root`'s tensors are exactly those of `table`; raises ValueError if not."""
    fqns: dict[str, str] = module.get_constant_names_to_original_fqns()
    codes: dict[str, int] = module.get_constant_names_to_dtypes()
    if sorted(fqns) != [row[0] for row in table]:
        raise ValueError("the library's constants differ from its table")
    bound: dict[str, torch.Tensor] = {}
    for name, fqn, code, dtype, shape, stride in table:
        t = _resolve(root, fqn)
        if fqns[name] != fqn or codes[name] != code:
            raise ValueError(f"graph constant {name}: the library reads {fqns[name]} (dtype code {codes[name]})")
        if [str(t.dtype), list(t.shape), list(t.stride())] != [dtype, shape, stride]:
            raise ValueError(f"graph constant {fqn}: the model has {t.dtype} {list(t.shape)} stride "
                             f"{list(t.stride())}, the graph expects {dtype} {shape} stride {stride}")
        bound[name] = t
    # use the active buffer, check every constant is given, keep the caller's tensors (user-managed, no copy)
    module.update_constant_buffer(bound, False, True, True)


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
