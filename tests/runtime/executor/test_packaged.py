"""Decode graphs as AOTInductor packages through the artifact cache (--compile-mode sync; background mode
uses the same packages, tested end to end in tests/server/test_startup.py): a tiny random Llama, float32
activations over int8 weights with float32 dense copies from 8 rows on, so the default layout of graphs: buckets
1, 2, 4 in one dynamic-batch graph bound to the live weights, bucket 8 in a graph with its dense copies frozen in.
Greedy tokens equal eager's over 24 steps at one row (bucket 1) and at eight rows (bucket 8), and a second runner
over the same cache loads both packages, binds the first to its own weights and serves both buckets without
compiling. A library is bound only to tensors that match its constants table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernels import fallbacks
from runtime.config import make_config
from runtime.executor import graph_package
from runtime.executor.greedy import greedy_generate
from runtime.executor.model_runner import create_model_runner
from tests.runtime.models.tiny import tiny_checkpoint


def _runner(path: str, cache: str, mode: str):
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIXGEN_DISABLE_COMPILE", "0")
    try:
        cfg = make_config(model_path=path, dtype="float32", max_total_tokens=2048, max_running_requests=8,
                          compile_mode=mode, compile_max_bs=8, quantization="int8", compile_cache_dir=cache)
        return create_model_runner(cfg, progress=False)
    finally:
        mp.undo()


def test_sync_package_matches_eager_and_a_restart_loads_it(tmp_path, monkeypatch):
    # The key names the start-up fallbacks in effect; the restart below is a fresh process with none, so this
    # process must have none either (other tests of a session may have recorded some).
    monkeypatch.setattr(fallbacks, "_recorded", {})
    path, cache = tiny_checkpoint(tmp_path / "tiny", "llama"), str(tmp_path / "graphs")
    eager, compiled = _runner(path, cache, "off"), _runner(path, cache, "sync")
    assert compiled.compile is not None and compiled.compile.compiled_here.keys() == {(1, 2, 4), (8,)}
    assert [compiled.compile.weights(g) for g in compiled.compile.groups] == ["bound", "embedded"]
    assert compiled.graph_runner is not None and set(compiled.graph_runner.graphs) == {1, 2, 4, 8}
    # buckets 1 and 8 (8 rows: eager takes the dense copies as the bucket's graph does; padded rows would not)
    prompts = [[[5, 17, 42, 9, 100]], [[5 + i, 17, 42 * i % 300, 9] for i in range(8)]]
    want = [greedy_generate(eager, p, 24) for p in prompts]
    assert [greedy_generate(compiled, p, 24) for p in prompts] == want
    assert compiled.graph_runner.replays == 2 * 23
    bound = compiled.compile.cache.lookup_entry(compiled.compile.key((1, 2, 4)))
    assert bound is not None and len(bound[1]["constants"]) > 10  # every weight by name: none in the library

    # a restart: a new process (the attention backend registry starts empty there, as in a server's scheduler)
    out = subprocess.run([sys.executable, "-c", RESTART, path, cache, json.dumps(prompts)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    state, tokens = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["compiled_buckets"] == [1, 2, 4, 8] and state["compile_cache"]["hits"] == 2, state
    assert state["compile_worker_pid"] is None and state["compiled_replays"] == 2 * 23
    assert tokens == want


class _Library:
    """The constant-table side of a loaded library: two constants, what it was given."""

    def __init__(self) -> None:
        self.given: dict[str, torch.Tensor] | None = None

    def get_constant_names_to_original_fqns(self) -> dict[str, str]:
        return {"lin_weight": "lin.weight", "lin_bias": "lin.bias"}

    def get_constant_names_to_dtypes(self) -> dict[str, int]:
        return {"lin_weight": 6, "lin_bias": 6}

    def update_constant_buffer(self, tensors, use_inactive, validate_full, user_managed) -> None:
        assert (use_inactive, validate_full, user_managed) == (False, True, True)
        self.given = tensors


def test_constants_bind_only_to_tensors_matching_the_table():
    root = torch.nn.Module()
    root.lin = torch.nn.Linear(4, 3)
    table = graph_package.constants_table(_Library(), root)
    assert table == [["lin_bias", "lin.bias", 6, "torch.float32", [3], [1]],
                     ["lin_weight", "lin.weight", 6, "torch.float32", [3, 4], [4, 1]]]
    lib = _Library()
    graph_package.bind_constants(lib, root, table)
    assert lib.given is not None and lib.given["lin_weight"] is root.lin.weight  # the live tensor, no copy
    other = torch.nn.Module()
    other.lin = torch.nn.Linear(4, 5)  # another shape under the same names
    with pytest.raises(ValueError, match="lin.bias"):
        graph_package.bind_constants(_Library(), other, table)
    with pytest.raises(ValueError, match="differ"):
        graph_package.bind_constants(_Library(), root, table[:1])


RESTART = """
import json, sys
from runtime.executor import aot_graph
def no_compile(*a, **k):
    raise AssertionError("a cached bucket was compiled again")
aot_graph.compile_package = no_compile
from tests.runtime.executor.test_packaged import _runner
from runtime.executor.greedy import greedy_generate
r = _runner(sys.argv[1], sys.argv[2], "background")  # everything cached: no compile process either
r.compile.wait_loaded(60)  # the loader thread verifies and loads the cached bucket
tokens = [greedy_generate(r, p, 24) for p in json.loads(sys.argv[3])]
print(json.dumps([r.compile_state(), tokens]))
"""
