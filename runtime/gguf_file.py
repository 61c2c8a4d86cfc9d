"""GGUF files read once per process, and their metadata read fast.

gguf.GGUFReader parses every metadata field eagerly, one numpy view per array element: SmolLM2's 49,152-token
vocabulary and its merges take about 2.5 s on a 2-core EPYC, and the weight loader, the EOS and architecture
lookups and the tokenizer (in the server, scheduler and detokenizer processes) each read the file. So:
- `reader(path)`: the GGUFReader (tensors and all), parsed once per process (the weight loader);
- `metadata(path)`: the key/value header only, as GGUFReader's `field.contents()` gives it, parsed by this
  module with bulk reads (~0.1 s; tests/runtime/test_gguf_file.py checks it equals GGUFReader's).
Both are cached while the file is unchanged (same size and mtime). The reader memory-maps the file: keeping it
keeps the pages the loader touched mapped (file-backed, reclaimable), and saves the parse when a process builds
several runners of one model (the test suite does).

Metadata layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key count, then per
key: string key, u32 value type, value. Strings are u64 length + UTF-8 bytes; an array is u32 element type,
u64 count, then the elements.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any

import numpy as np

# value type -> (struct format, numpy dtype) for the fixed-size scalars
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


def reader(path: str) -> Any:
    """The gguf.GGUFReader of `path`, parsed once per process while the file is unchanged."""
    st = os.stat(path)
    return _parse(os.path.realpath(path), st.st_size, st.st_mtime_ns)


def metadata(path: str) -> dict[str, Any]:
    """{key: value} of the file's metadata (str, int, float, bool, or a list of those), as GGUFReader's
    `fields[key].contents()`. The returned dict is shared: do not mutate it."""
    st = os.stat(path)
    return _read_metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parse(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


class _Short(Exception):
    """The bytes read so far end inside the metadata: read more."""


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Short

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALARS[vtype][0]
        size = struct.calcsize(fmt)
        self.need(size)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        self.need(8)
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.need(8 + n)
        s = bytes(self.buf[self.pos + 8 : self.pos + 8 + n]).decode("utf-8", errors="replace")
        self.pos += 8 + n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            self.need(12)
            etype, n = struct.unpack_from("<IQ", self.buf, self.pos)
            self.pos += 12
            if etype in _SCALARS:  # one bulk read
                dt = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                self.need(n * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"GGUF metadata: unknown value type {vtype} at byte {self.pos}")
        return self.scalar(vtype)


@functools.lru_cache(maxsize=4)
def _read_metadata(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, _, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (2 or 3 supported)")
        chunk = 1 << 22
        data = bytearray(head)
        while True:  # the header is at the front: read until every key parses
            more = f.read(chunk)
            data += more
            cur = _Cursor(memoryview(bytes(data)))
            cur.pos = 24
            try:
                out: dict[str, Any] = {}
                for _ in range(n_kv):
                    key = cur.string()
                    cur.need(4)
                    (vtype,) = struct.unpack_from("<I", cur.buf, cur.pos)
                    cur.pos += 4
                    out[key] = cur.value(vtype)
                return out
            except _Short:
                if not more:
                    raise ValueError(f"{path}: truncated GGUF metadata") from None
                chunk *= 2
