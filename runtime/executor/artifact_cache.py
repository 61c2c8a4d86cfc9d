"""On-disk cache of start-up artifacts, one entry per key: compiled decode graphs (AOTInductor packages), and
int8 calibration statistics (runtime/executor/calibration_cache.py, payload calibration.safetensors).

Layout under the root (default ~/.cache/radixgen/graphs, RADIXGEN_CACHE_DIR or --compile-cache-dir):
  <digest>/graph.so       the compiled graph (an AOTInductor package's shared library, weights embedded), or the
                          cache's own payload file
  <digest>/graph.json     its custom-op call table, when the graph has one (a sidecar: see `store`)
  <digest>/entry.json     {"key": {...}, "sha256": hex of graph.so, "bytes": n,
                           "sidecar": {"sha256": hex of graph.json, "bytes": n} or absent,
                           "constants": the graph's constants table (graph_package.constants_table) or absent},
                          written last
where <digest> is sha256 of the key's canonical JSON. An entry is trusted only when entry.json parses, its key
equals the key asked for (a foreign or colliding directory is not) and graph.so (and its sidecar) hashes to its sha256 (a
truncated or altered file is not). Anything else is removed and counted as `rejected`; the caller recompiles.

Writers publish atomically: the package and manifest go into a temporary directory beside the entries, which
is renamed into place, so a reader never sees a half-written entry. After each store the least recently used
entries (by entry.json's mtime, touched on every hit) are removed until the total is under `max_bytes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PACKAGE, SIDECAR, MANIFEST = "graph.so", "graph.json", "entry.json"
DEFAULT_MAX_BYTES = 4 << 30


def default_root() -> Path:
    """~/.cache/radixgen/graphs (XDG_CACHE_HOME respected)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixgen" / "graphs"


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ArtifactCache:
    def __init__(self, root: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES, payload: str = PACKAGE,
                 label: str = "compiled graph cache") -> None:
        """`payload`: the file name an entry's main file gets (graph.so for decode graphs); `label` names the
        cache in its warnings."""
        self.root = Path(root) if root else default_root()
        self.max_bytes = max_bytes
        self.payload, self.label = payload, label
        self.hits = self.misses = self.rejected = 0

    def entry_dir(self, key: dict[str, Any]) -> Path:
        return self.root / key_digest(key)

    def lookup(self, key: dict[str, Any]) -> Path | None:
        """The package path of a verified entry for `key`, or None (missing; or rejected and removed)."""
        found = self.lookup_entry(key)
        return found[0] if found is not None else None

    def lookup_entry(self, key: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
        """The package path and manifest of a verified entry for `key`, or None (missing; or rejected and removed)."""
        d = self.entry_dir(key)
        manifest = d / MANIFEST
        if not manifest.exists():
            self.misses += 1
            return None
        meta: dict[str, Any] = {}
        why = self._verify(d, key, meta)
        if why is not None:
            self.rejected += 1
            log.warning("%s: rejected entry %s (%s); it will be made again", self.label, d, why)
            shutil.rmtree(d, ignore_errors=True)
            return None
        self.hits += 1
        os.utime(manifest)  # LRU: most recently used
        return d / self.payload, meta

    def _verify(self, d: Path, key: dict[str, Any], out: dict[str, Any]) -> str | None:
        """None when the entry is trustworthy (its manifest then copied into `out`), else why not."""
        try:
            meta = json.loads((d / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            return f"unreadable manifest: {type(e).__name__}"
        if not isinstance(meta, dict) or meta.get("key") != key:
            return "key mismatch"
        files = [(d / self.payload, meta)]
        if isinstance(meta.get("sidecar"), dict):
            files.append((d / SIDECAR, meta["sidecar"]))
        elif (d / SIDECAR).exists():
            return "sidecar not in the manifest"
        try:
            for f, m in files:
                if f.stat().st_size != m.get("bytes") or file_sha256(f) != m.get("sha256"):
                    return "checksum mismatch"
        except OSError as e:
            return f"unreadable package: {type(e).__name__}"
        out.update(meta)
        return None

    def discard(self, key: dict[str, Any], why: str) -> None:
        """Remove the entry for `key` (it verified but did not load): counted as rejected, recompiled."""
        self.rejected += 1
        log.warning("%s: rejected entry %s (%s); it will be made again", self.label, self.entry_dir(key), why)
        shutil.rmtree(self.entry_dir(key), ignore_errors=True)

    def store(self, key: dict[str, Any], package: Path, constants: list[Any] | None = None) -> Path:
        """Move `package` (and its sidecar, `package` with suffix .json, if there is one) into the entry for
        `key` (replacing any old one), its constants table in the manifest; returns the package's final path."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        shutil.move(str(package), tmp / self.payload)
        meta: dict[str, Any] = {"key": key, "sha256": file_sha256(tmp / self.payload),
                                "bytes": (tmp / self.payload).stat().st_size}
        side = package.with_suffix(".json")
        if side.exists():
            shutil.move(str(side), tmp / SIDECAR)
            meta["sidecar"] = {"sha256": file_sha256(tmp / SIDECAR), "bytes": (tmp / SIDECAR).stat().st_size}
        if constants is not None:
            meta["constants"] = constants
        (tmp / MANIFEST).write_text(json.dumps(meta, sort_keys=True))
        d = self.entry_dir(key)
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        self.evict(keep=d)
        return d / self.payload

    def entries(self) -> list[tuple[Path, int, float]]:
        """(dir, bytes, last use) of every published entry."""
        out: list[tuple[Path, int, float]] = []
        if not self.root.is_dir():
            return out
        for d in self.root.iterdir():
            m = d / MANIFEST
            if d.name.startswith(".") or not m.exists():
                continue
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            out.append((d, size, m.stat().st_mtime))
        return out

    def evict(self, keep: Path | None = None) -> int:
        """Remove least recently used entries (never `keep`) until the total is <= max_bytes; returns how many."""
        entries = sorted(self.entries(), key=lambda e: e[2])
        total = sum(e[1] for e in entries)
        n = 0
        for d, size, _ in entries:
            if total <= self.max_bytes:
                break
            if d == keep:
                continue
            shutil.rmtree(d, ignore_errors=True)
            total -= size
            n += 1
        return n

    def clear(self) -> int:
        """Remove the whole cache (entries and leftovers); returns the bytes freed."""
        if not self.root.exists():
            return 0
        freed = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        shutil.rmtree(self.root, ignore_errors=True)
        return freed
