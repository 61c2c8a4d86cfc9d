"""TierStore: the radix cache's second tier, a file-backed store of KV chunks on local disk.

Data flow: the pool side cuts a token path into chunks of `chunk` tokens and names chunk i by `chunk_keys`,
a hash chain over the identity and every token of chunks 0..i (so a key names a whole token-id path, never a
chunk's tokens alone). `put(key, ...)` queues a KV copy for the background writer and returns at once;
`get(key, ...)` returns the chunk's KV (from the writer's queue if not yet on disk) or None.

Entry file `<dir>/<identity digest>/<key>.kv` = MAGIC (8 bytes) | header length u32 | header crc32 u32 |
header (JSON: identity, key, start, tokens, dtype, shape, payload crc32) | payload (the KV tensor's bytes).
It is written to `<key>.kv.tmp` and renamed over, so a crash mid-write leaves at most a `.tmp`, removed on
the next start. Invariants:
- An entry is served only after its header (magic, header crc, identity, key, start, tokens) and its payload
  crc are checked against what the caller asks for; anything else is rejected (counted) and deleted.
- `used_bytes <= limit_bytes` after every write: the least-recently-used entries are deleted first.
- Every OSError degrades to a miss or a dropped write (counted, one warning per kind); nothing here raises
  to the caller after construction, and `put` never blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

MAGIC = b"RGKVT001"
_PREFIX = struct.Struct("<8sII")  # magic, header length, header crc32
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16,
                                                      torch.int64, torch.int32, torch.int8, torch.uint8)}


def identity_digest(identity: dict[str, Any]) -> str:
    """Stable digest of the identity (model file, dtypes, page layout, shapes): names the entry directory."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def chunk_keys(token_ids: list[int], chunk: int, digest: str) -> list[str]:
    """Key of every whole chunk of `token_ids`: key i hashes the digest and tokens [0, (i+1)*chunk)."""
    h = hashlib.sha256(digest.encode()).digest()
    out = []
    for start in range(0, len(token_ids) - chunk + 1, chunk):
        h = hashlib.sha256(h + array("q", token_ids[start : start + chunk]).tobytes()).digest()
        out.append(h.hex()[:40])
    return out


@dataclass
class TierStats:
    """Cumulative counters (written by both threads; each update is one GIL-held int/float add)."""

    written_entries: int = 0
    written_bytes: int = 0
    written_tokens: int = 0
    loaded_entries: int = 0
    loaded_bytes: int = 0
    loaded_tokens: int = 0
    load_s: float = 0.0
    rejected_entries: int = 0  # torn, truncated, corrupt, foreign or stale entries found and never served
    dropped_writes: int = 0  # queue full, or an I/O error while writing
    write_errors: int = 0
    read_errors: int = 0
    evicted_entries: int = 0
    warned: set[str] = field(default_factory=set)


@dataclass
class _Job:
    key: str
    start: int
    tokens: list[int]
    kv: torch.Tensor


def _buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


def _write_atomic(path: str, parts: list[bytes | memoryview]) -> None:
    """Write `parts` to `path` through a temp file and an atomic rename (a crash leaves only the .tmp)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for p in parts:
            f.write(p)
    os.replace(tmp, path)


class TierStore:
    """The file tier of one identity. Thread-safe: the caller's thread calls put/get/contains/clear, the
    writer thread writes; `_lock` guards the index and `_pending`."""

    def __init__(self, root: str, identity: dict[str, Any], limit_bytes: int, max_queue: int = 64) -> None:
        self.identity = identity
        self.digest = identity_digest(identity)
        self.dir = os.path.join(os.path.expanduser(root), self.digest)
        self.limit_bytes = limit_bytes
        self.stats = TierStats()
        self.write_file: Callable[[str, list[bytes | memoryview]], None] = _write_atomic  # tests inject faults
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._pending: dict[str, _Job] = {}
        self.used_bytes = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
        self.enabled = self._open()
        self._thread = threading.Thread(target=self._writer, name="hicache-writer", daemon=True)
        if self.enabled:
            self._thread.start()

    # ---- start-up -------------------------------------------------------------------------------------------
    def _open(self) -> bool:
        """Create the directory, prove it writable, rebuild the index from the entries found (each one's
        header checked; torn `.tmp` files and bad entries deleted and counted). False: tier off (warned)."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, ".probe")
            _write_atomic(probe, [b"ok"])
            os.unlink(probe)
        except OSError as e:
            self._warn("open", f"hierarchical cache disabled: directory {self.dir} is not writable ({e})")
            return False
        found = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.endswith(".tmp"):
                self._drop_file(path, rejected=True)
            elif name.endswith(".kv"):
                size = self._check_file(path, name[:-3])
                if size is None:
                    self._drop_file(path, rejected=True)
                else:
                    found.append((os.stat(path).st_mtime_ns, name[:-3], size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        self._shrink(0)
        return True

    def _check_file(self, path: str, key: str) -> int | None:
        """File size if the header is intact, names this key and identity, and the length matches."""
        try:
            with open(path, "rb") as f:
                header = self._read_header(f, key)
                size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError):
            return None
        if header is None or size != self._expected_size(header):
            return None
        return size

    def _read_header(self, f: Any, key: str) -> dict[str, Any] | None:
        raw = f.read(_PREFIX.size)
        if len(raw) != _PREFIX.size:
            return None
        magic, hlen, hcrc = _PREFIX.unpack(raw)
        body = f.read(hlen)
        if magic != MAGIC or len(body) != hlen or zlib.crc32(body) != hcrc:
            return None
        header: dict[str, Any] = json.loads(body)
        if header.get("identity") != self.identity or header.get("key") != key or header.get("dtype") not in _DTYPES:
            return None
        header["_payload_at"] = _PREFIX.size + hlen
        return header

    @staticmethod
    def _expected_size(header: dict[str, Any]) -> int:
        n = 1
        for s in header["shape"]:
            n *= int(s)
        return int(header["_payload_at"]) + n * _DTYPES[header["dtype"]].itemsize

    # ---- the caller's side ----------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def put(self, key: str, start: int, tokens: list[int], kv: torch.Tensor) -> bool:
        """Queue chunk `key` (path position `start`, its `tokens`, KV `kv` token-major on the CPU, owned by the
        store from now on). False when already stored or queued, the tier is off, or the queue is full."""
        if not self.enabled:
            return False
        job = _Job(key, start, list(tokens), kv)
        with self._lock:
            if key in self._index or key in self._pending:
                return False
            self._pending[key] = job
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self._pending.pop(key, None)
            self.stats.dropped_writes += 1
            return False
        return True

    def get(self, key: str, start: int, tokens: list[int]) -> torch.Tensor | None:
        """KV of chunk `key`, checked against `start` and `tokens`; None when absent or rejected."""
        t0 = time.perf_counter()
        with self._lock:
            job = self._pending.get(key)
            present = job is not None or key in self._index
            if key in self._index:
                self._index.move_to_end(key)
        if not present:
            return None
        if job is not None:
            kv: torch.Tensor | None = job.kv if job.start == start and job.tokens == tokens else None
        else:
            kv = self._load(key, start, tokens)
        if kv is not None:
            self.stats.loaded_entries += 1
            self.stats.loaded_tokens += len(tokens)
            self.stats.loaded_bytes += kv.numel() * kv.element_size()
            self.stats.load_s += time.perf_counter() - t0
        return kv

    def _load(self, key: str, start: int, tokens: list[int]) -> torch.Tensor | None:
        path = self._path(key)
        header, buf, got = None, torch.empty(0, dtype=torch.uint8), -1
        try:
            with open(path, "rb") as f:
                header = self._read_header(f, key)
                if header is not None:
                    buf = torch.empty(self._expected_size(header) - header["_payload_at"], dtype=torch.uint8)
                    got = f.readinto(_buffer(buf)) if buf.numel() else 0
                    got += len(f.read(1))  # a longer file is as wrong as a shorter one
        except (OSError, ValueError) as e:
            if isinstance(e, OSError):
                self.stats.read_errors += 1
                self._warn("read", f"hierarchical cache read failed ({e}); recomputing")
            header = None
        ok = (header is not None and header.get("start") == start and header.get("tokens") == tokens
              and got == buf.numel() and zlib.crc32(_buffer(buf)) == header.get("crc32"))
        if not ok or header is None:
            self._forget(key)
            self._drop_file(path, rejected=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU order survives a restart
        return buf.view(_DTYPES[header["dtype"]]).reshape(header["shape"])

    def clear(self) -> int:
        """Delete every entry (the writer's queue too); return how many were deleted."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            keys = list(self._index)
            self._index.clear()
            self._pending.clear()
            self.used_bytes = 0
        for key in keys:
            self._drop_file(self._path(key), rejected=False)
        return len(keys)

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (up to `timeout` seconds) and stop the writer."""
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
            self._thread.join(timeout)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is done (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return
            time.sleep(0.005)

    def entries(self) -> int:
        with self._lock:
            return len(self._index)

    # ---- the writer's side ----------------------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception as e:  # fail-soft: a write that fails loses only this entry
                self.stats.write_errors += 1
                self.stats.dropped_writes += 1
                self._warn("write", f"hierarchical cache write failed ({e}); entries are recomputed instead")
            finally:
                with self._lock:
                    self._pending.pop(job.key, None)

    def _write(self, job: _Job) -> None:
        with self._lock:
            if job.key not in self._pending:  # cleared meanwhile
                return
        kv = job.kv.contiguous()
        payload = kv.view(torch.uint8).reshape(-1).numpy().data if kv.numel() else memoryview(b"")
        header = json.dumps({"identity": self.identity, "key": job.key, "start": job.start, "tokens": job.tokens,
                             "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape),
                             "crc32": zlib.crc32(payload)}).encode()
        size = _PREFIX.size + len(header) + len(payload)
        if size > self.limit_bytes:
            self.stats.dropped_writes += 1
            return
        self._shrink(size)
        self.write_file(self._path(job.key), [_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)), header, payload])
        with self._lock:
            if job.key in self._pending:
                self._index[job.key] = size
                self.used_bytes += size
        self.stats.written_entries += 1
        self.stats.written_tokens += len(job.tokens)
        self.stats.written_bytes += size

    def _shrink(self, incoming: int) -> None:
        """Delete least-recently-used entries until `incoming` more bytes fit under the limit."""
        while True:
            with self._lock:
                if not self._index or self.used_bytes + incoming <= self.limit_bytes:
                    return
                key, size = self._index.popitem(last=False)
                self.used_bytes -= size
            self.stats.evicted_entries += 1
            self._drop_file(self._path(key), rejected=False)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".kv")

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def _drop_file(self, path: str, rejected: bool) -> None:
        if rejected:
            self.stats.rejected_entries += 1
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _warn(self, kind: str, message: str) -> None:
        """One warning per kind of failure; later ones are only counted."""
        if kind not in self.stats.warned:
            self.stats.warned.add(kind)
            log.warning(message)
