"""The background decode-graph compiler: a separate, lowest-priority process that loads the model as the
server does and writes one AOTInductor package per missing group of buckets into the artifact cache.

Run by runtime/executor/compile_manager.py as `python -m runtime.executor.compile_worker` with one JSON
object on stdin: {"model": ModelConfig fields, "groups": [[[1, 2, 4], "bound"], ...] (buckets, weights mode),
"key_base": {...}, "backend_id": n,
"cache_root": str, "cache_max_bytes": n}. Groups are compiled smallest first (batch 1 is the commonest decode
batch); each is published atomically, so the server can load it at its next step boundary. It dies with its parent
(PR_SET_PDEATHSIG) and writes one JSON line per bucket to stdout for the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux); elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def compile_missing(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Compile every group of `job` whose cache entry is missing or rejected; returns what it did per group."""
    from runtime.config import make_config
    from runtime.executor import aot_graph
    from runtime.executor.artifact_cache import ArtifactCache
    from runtime.executor.cuda_graph import CPU_BUCKETS, DecodeGraphRunner
    from runtime.executor.model_runner import create_model_runner
    from runtime.models import attn_op

    groups = sorted((tuple(int(b) for b in g), str(w)) for g, w in job["groups"])
    buckets = sorted(b for g, _ in groups for b in g)
    model = {**job["model"], "compile_mode": "off", "disable_compile": True}
    cfg = make_config(**model, max_total_tokens=max(256, 2 * buckets[-1]), max_running_requests=buckets[-1])
    runner = create_model_runner(cfg, progress=False)
    # the graphs call attention by registry index: the server's index for this process's backend
    backend_id = attn_op.register_backend(runner.attn, at=int(job["backend_id"]))
    graphs = DecodeGraphRunner(runner.model, runner.attn, runner.req_to_token.table, runner.pool.pad_slot,
                               buckets[-1], graph_factory=_no_graph,
                               attend=attn_op.opaque_attend(backend_id), buckets=CPU_BUCKETS, label="packages")
    cache = ArtifactCache(job["cache_root"], int(job["cache_max_bytes"]))
    done: list[dict[str, Any]] = []
    for g, weights in groups:
        key = aot_graph.graph_key(job["key_base"], g, weights)
        if cache.lookup(key) is not None:
            done.append({"buckets": list(g), "cached": True})
            continue
        with tempfile.TemporaryDirectory(dir=_tmp_parent(cache.root)) as tmp:
            out = Path(tmp) / "graph.so"
            seconds, table = aot_graph.compile_package(graphs, g, out, weights)
            cache.store(key, out, table)
        rec = {"buckets": list(g), "seconds": round(seconds, 1)}
        print(json.dumps(rec), flush=True)
        done.append(rec)
    return done


def _tmp_parent(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


def _no_graph() -> Any:
    raise AssertionError("the compile worker exports groups one at a time; it never captures")


def main() -> int:
    die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(19)
    job = json.loads(sys.stdin.read())
    compile_missing(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
