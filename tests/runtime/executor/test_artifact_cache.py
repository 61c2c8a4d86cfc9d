"""The compiled-graph artifact cache (runtime/executor/artifact_cache.py): only an entry whose manifest names
the same key and whose package matches its checksum is loaded; anything else is removed and counted; LRU
bound; `radixgen cache clear`. Plain files stand in for packages (the cache never opens them)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from runtime.executor import aot_graph
from runtime.executor.artifact_cache import MANIFEST, PACKAGE, SIDECAR, ArtifactCache
from server.cli import main as cli_main

KEY = {"model": {"path": "/m.gguf", "bytes": 1}, "dtype": "float32", "quantization": "gguf", "bucket": 1}


def _pkg(tmp: Path, n: int = 1000, fill: bytes = b"x") -> Path:
    p = tmp / f"src-{time.monotonic_ns()}.pt2"
    p.write_bytes(fill * n)
    return p


def test_store_then_lookup_hits(tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    stored = cache.store(KEY, _pkg(tmp_path))
    assert cache.lookup(KEY) == stored and stored.read_bytes() == b"x" * 1000
    assert (cache.hits, cache.misses, cache.rejected) == (1, 0, 0)
    assert cache.lookup({**KEY, "bucket": 2}) is None and cache.misses == 1


def test_sidecar_is_stored_and_checked(tmp_path):
    """A graph's custom-op call table (the .json beside the library) travels with it and is verified too."""
    cache = ArtifactCache(tmp_path / "c")
    src = _pkg(tmp_path)
    src.with_suffix(".json").write_text('{"nodes": [0]}')
    stored = cache.store(KEY, src)
    side = stored.with_name(SIDECAR)
    assert side.read_text() == '{"nodes": [0]}' and cache.lookup(KEY) == stored
    side.write_text('{"nodes": [1]}')  # same size, other content
    assert cache.lookup(KEY) is None and cache.rejected == 1 and not stored.parent.exists()
    stored = cache.store(KEY, _pkg(tmp_path))  # no sidecar in the manifest: a stray one is refused
    stored.with_name(SIDECAR).write_text("{}")
    assert cache.lookup(KEY) is None and cache.rejected == 2


def test_corrupt_package_is_rejected_removed_and_counted(tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    stored = cache.store(KEY, _pkg(tmp_path))
    data = bytearray(stored.read_bytes())
    data[500] ^= 1  # same size, one bit flipped
    stored.write_bytes(bytes(data))
    assert cache.lookup(KEY) is None
    assert cache.rejected == 1 and not stored.parent.exists()
    assert cache.lookup(KEY) is None and cache.misses == 1  # gone: the next start recompiles


def test_truncated_package_and_broken_manifest_are_rejected(tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    stored = cache.store(KEY, _pkg(tmp_path))
    stored.write_bytes(b"x" * 10)
    assert cache.lookup(KEY) is None and cache.rejected == 1
    stored = cache.store(KEY, _pkg(tmp_path))
    (stored.parent / MANIFEST).write_text("{not json")
    assert cache.lookup(KEY) is None and cache.rejected == 2


def test_foreign_entry_under_the_keys_directory_is_never_loaded(tmp_path):
    """A directory at this key's place whose manifest names another key (another model, another torch, or a
    planted file with a self-consistent checksum) is rejected, whatever its checksum says."""
    cache = ArtifactCache(tmp_path / "c")
    other = {**KEY, "torch": "0.0"}
    stored = cache.store(other, _pkg(tmp_path, fill=b"y"))
    target = cache.entry_dir(KEY)
    shutil.copytree(stored.parent, target)
    assert json.loads((target / MANIFEST).read_text())["key"] == other
    assert cache.lookup(KEY) is None and cache.rejected == 1 and not target.exists()
    assert cache.lookup(other) is not None  # the genuine entry stays valid


def test_lru_bound_keeps_the_recently_used_entries(tmp_path):
    cache = ArtifactCache(tmp_path / "c", max_bytes=2500)  # room for two 1000-byte packages and manifests
    keys = [{**KEY, "bucket": b} for b in (1, 2, 3)]
    cache.store(keys[0], _pkg(tmp_path))
    cache.store(keys[1], _pkg(tmp_path))
    old = time.time() - 100
    os.utime(cache.entry_dir(keys[1]) / MANIFEST, (old, old))  # bucket 2 used long ago
    assert cache.lookup(keys[0]) is not None  # bucket 1 used now
    cache.store(keys[2], _pkg(tmp_path))
    assert cache.entry_dir(keys[0]).exists() and cache.entry_dir(keys[2]).exists()
    assert not cache.entry_dir(keys[1]).exists()
    assert sum(e[1] for e in cache.entries()) <= 2500


def test_cli_cache_clear_removes_the_cache(tmp_path, capsys):
    root = tmp_path / "c"
    cache = ArtifactCache(root)
    cache.store(KEY, _pkg(tmp_path))
    assert (cache.entry_dir(KEY) / PACKAGE).exists()
    assert cli_main(["cache", "info", "--compile-cache-dir", str(root)]) == 0
    assert "1 entries" in capsys.readouterr().out
    assert cli_main(["cache", "clear", "--compile-cache-dir", str(root)]) == 0
    assert not root.exists() and "removed" in capsys.readouterr().out


def test_key_changes_with_the_model_file_and_the_quantization(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"a" * 4096)
    args = ("float32", "gguf", "auto", "float16", "cpu", 0)
    base = aot_graph.key_base(str(model), *args)
    assert base == aot_graph.key_base(str(model), *args)
    assert base["code"] and base["torch"] and base["cpu"]
    assert aot_graph.key_base(str(model), "float32", "w8a8_int8", *args[2:]) != base
    model.write_bytes(b"b" * 4096)
    assert aot_graph.key_base(str(model), *args)["model"] != base["model"]
    assert aot_graph.graph_key(base, (1,), "bound") != aot_graph.graph_key(base, (1, 2), "bound")
    assert aot_graph.graph_key(base, (1,), "bound") != aot_graph.graph_key(base, (1,), "embedded")
    assert aot_graph.graph_key(base, (1, 2, 4), "bound")["bucket"] == [1, 2, 4]


def test_buckets_are_grouped_between_row_thresholds():
    buckets = (1, 2, 4, 8, 16, 32)
    assert aot_graph.bucket_groups(buckets, {8}) == [(1, 2, 4), (8, 16, 32)]
    assert aot_graph.bucket_groups(buckets, set()) == [buckets]  # one path at every row count: one graph
    assert aot_graph.bucket_groups(buckets, {256}) == [buckets]  # a threshold above the largest bucket
    assert aot_graph.bucket_groups(buckets, {3, 16}) == [(1, 2), (4, 8), (16, 32)]
    assert aot_graph.bucket_groups((1,), {8}) == [(1,)]


def test_the_constants_table_comes_back_with_the_verified_entry(tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    table = [["model_w", "model.w", 6, "torch.float32", [4, 2], [2, 1]]]
    cache.store(KEY, _pkg(tmp_path), table)
    found = cache.lookup_entry(KEY)
    assert found is not None and found[1]["constants"] == table
