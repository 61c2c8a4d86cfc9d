"""Decode graphs as AOTInductor packages through the artifact cache (--compile-mode sync; background mode
uses the same packages, tested end to end in tests/server/test_startup.py): a tiny random float32 Llama,
bucket 1. The package's greedy tokens equal eager's over 24 steps (float32, as the JIT graphs promise), and a
second runner over the same cache loads the package without compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernels import fallbacks
from runtime.config import make_config
from runtime.executor.greedy import greedy_generate
from runtime.executor.model_runner import create_model_runner
from tests.runtime.models.tiny import tiny_checkpoint


def _runner(path: str, cache: str, mode: str):
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIXGEN_DISABLE_COMPILE", "0")
    try:
        cfg = make_config(model_path=path, dtype="float32", max_total_tokens=2048, max_running_requests=4,
                          compile_mode=mode, compile_max_bs=1, quantization="none", compile_cache_dir=cache)
        return create_model_runner(cfg, progress=False)
    finally:
        mp.undo()


def test_sync_package_matches_eager_and_a_restart_loads_it(tmp_path, monkeypatch):
    # The key names the start-up fallbacks in effect; the restart below is a fresh process with none, so this
    # process must have none either (other tests of a session may have recorded some).
    monkeypatch.setattr(fallbacks, "_recorded", {})
    path, cache = tiny_checkpoint(tmp_path / "tiny", "llama"), str(tmp_path / "graphs")
    eager, compiled = _runner(path, cache, "off"), _runner(path, cache, "sync")
    assert compiled.compile is not None and compiled.compile.compiled_here.keys() == {1}
    assert compiled.graph_runner is not None and set(compiled.graph_runner.graphs) == {1}
    prompt = [[5, 17, 42, 9, 100]]
    want = greedy_generate(eager, prompt, 24)
    assert greedy_generate(compiled, prompt, 24) == want
    assert compiled.graph_runner.replays == 23

    # a restart: a new process (the attention backend registry starts empty there, as in a server's scheduler)
    out = subprocess.run([sys.executable, "-c", RESTART, path, cache, json.dumps(prompt)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    state, tokens = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["compiled_buckets"] == [1] and state["compile_cache"]["hits"] == 1, state
    assert state["compile_worker_pid"] is None and state["compiled_replays"] == 23
    assert tokens == want


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
tokens = greedy_generate(r, json.loads(sys.argv[3]), 24)
print(json.dumps([r.compile_state(), tokens]))
"""
