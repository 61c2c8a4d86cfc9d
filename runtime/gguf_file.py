"""GGUF files read once per process, and their metadata read fast.

gguf.GGUFReader parses every metadata field eagerly, one numpy view per array element: SmolLM2's 49,152-token
vocabulary and its merges take about 2.5 s on a 2-core EPYC, and the weight loader, the EOS and architecture
lookups and the tokenizer (in the server, scheduler and detokenizer processes) each read the file. So:
- `reader(path)`: the GGUFReader (tensors and all), parsed once per process (tools and tests);
- `metadata(path)`: the key/value header only, as GGUFReader's `field.contents()` gives it, parsed by this
  module with bulk reads (~0.1 s; tests/runtime/test_gguf_file.py checks it equals GGUFReader's);
- `tensors(path)`: the tensor infos that follow the metadata with views of the mapped data, as GGUFReader's
  `tensors` (the weight loader's path; the same test checks names, types, shapes and bytes).
Both are cached while the file is unchanged (same size and mtime). The reader memory-maps the file: keeping it
keeps the pages the loader touched mapped (file-backed, reclaimable), and saves the parse when a process builds
several runners of one model (the test suite does).

Metadata layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key count, then per
key: string key, u32 value type, value. Strings are u64 length + UTF-8 bytes; an array is u32 element type,
u64 count, then the elements. Then per tensor: string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32
type, u64 offset; the tensor data starts at the next multiple of `general.alignment` (default 32), offsets
relative to it.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any, NamedTuple

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


class Tensor(NamedTuple):
    """One tensor of the file, as gguf.GGUFReader's ReaderTensor gives it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # a read-only view of the mapped file: float types as such, block types as uint8 rows


def tensors(path: str) -> list[Tensor]:
    """The file's tensors (names, types, shapes, mapped data), as gguf.GGUFReader(path).tensors, from one
    bulk read of the header: the weight loader's path (~0.1 s where GGUFReader takes seconds)."""
    st = os.stat(path)
    return _tensors(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _tensors(path: str, size: int, mtime_ns: int) -> list[Tensor]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    _, infos, data_offset = _read_header(path, size, mtime_ns)
    mapped = np.memmap(path, mode="r")
    out: list[Tensor] = []
    for name, dims, raw_type, offset in infos:
        kind = GGMLQuantizationType(raw_type)
        n = int(np.prod(dims)) if dims else 1
        start = data_offset + offset
        item = _PLAIN.get(kind.name)
        np_dims = tuple(reversed(dims))
        if item is None:  # a block type: bytes, rows of blocks
            block, type_size = GGML_QUANT_SIZES[kind]
            nbytes = n * type_size // block
            view = mapped[start : start + nbytes]
            np_dims = quant_shape_to_byte_shape(np_dims, kind)
        else:
            nbytes = n * np.dtype(item).itemsize
            view = mapped[start : start + nbytes].view(item)
        if start + nbytes > size:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        out.append(Tensor(name, kind, dims, view.reshape(np_dims)))
    return out


_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}
_DEFAULT_ALIGNMENT = 32


@functools.lru_cache(maxsize=4)
def _read_metadata(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    return _read_header(path, size, mtime_ns)[0]


@functools.lru_cache(maxsize=4)
def _read_header(path: str, size: int, mtime_ns: int
                 ) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, tensor infos (name, dims in GGUF order, type, offset), offset of the tensor data)."""
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (2 or 3 supported)")
        chunk = 1 << 22
        data = bytearray(head)
        while True:  # the header is at the front: read until every key and tensor info parses
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
                infos = []
                for _ in range(n_tensors):
                    name = cur.string()
                    cur.need(4)
                    (n_dims,) = struct.unpack_from("<I", cur.buf, cur.pos)
                    cur.need(4 + 8 * n_dims + 12)
                    dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos + 4)
                    raw_type, offset = struct.unpack_from("<IQ", cur.buf, cur.pos + 4 + 8 * n_dims)
                    cur.pos += 4 + 8 * n_dims + 12
                    infos.append((name, tuple(int(d) for d in dims), int(raw_type), int(offset)))
                align = int(out.get("general.alignment", _DEFAULT_ALIGNMENT))
                if align <= 0 or align & (align - 1):
                    raise ValueError(f"{path}: GGUF alignment {align} is not a power of two")
                return out, infos, -(-cur.pos // align) * align
            except _Short:
                if not more:
                    raise ValueError(f"{path}: truncated GGUF header") from None
                chunk *= 2
