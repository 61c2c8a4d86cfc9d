"""Grammar compile worker: a plain subprocess (`python -m runtime.constrained.worker`) the backend can kill.

Protocol over stdin/stdout, each frame = 4-byte big-endian length + a msgpack map (msgspec; no pickle):
    parent -> worker  {"op": "init", "vocab": [bytes | None, ...], "eos": int}     once, first
    worker -> parent  {"op": "ready", "secs": float}
    parent -> worker  {"op": "compile", "id": int, "kind": str, "spec": str, "ws": str | None}
    worker -> parent  {"op": "done", "id": int, "ok": bool, "index": bytes, "regex": str, "error": str,
                       "code": str, "secs": float}
`index` is outlines-core's own serialization (`Index.__reduce__()` -> `Index.from_binary(bytes)`), so what
crosses the boundary is plain bytes. The worker is single-threaded; a runaway compile is stopped by the parent
killing the process (see backend.py), never by cooperation; its address space is capped (WORKER_MEMORY_LIMIT) so
an exploding build dies (reported as a crash) instead of swapping the machine.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from typing import TYPE_CHECKING, BinaryIO, cast

import msgspec

if TYPE_CHECKING:
    from outlines_core import Vocabulary

_HEADER = struct.Struct(">I")


def write_frame(out: BinaryIO, obj: object) -> None:
    data = msgspec.msgpack.encode(obj)
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> dict | None:
    """One frame, or None at EOF."""
    head = inp.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = inp.read(n)
    if len(data) < n:
        return None
    return cast(dict, msgspec.msgpack.decode(data))  # every frame of the protocol is a map


def build_vocabulary(vocab: list[bytes | None], eos: int) -> Vocabulary:
    from outlines_core import Vocabulary

    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab):
        if b is not None and i != eos and b:
            table.setdefault(b, []).append(i)
    return Vocabulary(eos, table)


def compile_one(vocabulary: Vocabulary, kind: str, spec: str, ws: str | None) -> dict:
    from outlines_core import Index

    from runtime.constrained.errors import GrammarValidationError
    from runtime.constrained.schema import to_regex

    t0 = time.perf_counter()
    try:
        regex = to_regex(kind, spec, ws)
        index = Index(regex, vocabulary)
        blob = index.__reduce__()[1][0]
        return {"ok": True, "index": blob, "regex": regex, "error": "", "code": "",
                "secs": time.perf_counter() - t0}
    except GrammarValidationError as e:
        return {"ok": False, "index": b"", "regex": "", "error": str(e), "code": e.code,
                "secs": time.perf_counter() - t0}
    except Exception as e:  # outlines-core's own errors (DFA build failures) name the problem
        return {"ok": False, "index": b"", "regex": "", "error": f"failed to compile {kind}: {e}",
                "code": "invalid_value", "secs": time.perf_counter() - t0}


WORKER_MEMORY_LIMIT = 4 << 30  # address-space cap: an exploding index build dies here instead of swapping


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the thread that spawned it dies (a killed scheduler leaves no orphan,
    even mid-compile, when the Rust build holds the GIL and no Python watchdog could run)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> int:
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return 1
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_LIMIT, WORKER_MEMORY_LIMIT))
    except (ImportError, ValueError, OSError):
        pass
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the real stdout
    init = read_frame(inp)
    if init is None or init.get("op") != "init":
        return 2
    t0 = time.perf_counter()
    vocabulary = build_vocabulary(init["vocab"], init["eos"])
    write_frame(out, {"op": "ready", "secs": time.perf_counter() - t0})
    while True:
        msg = read_frame(inp)
        if msg is None:
            return 0
        if msg.get("op") == "compile":
            res = compile_one(vocabulary, msg["kind"], msg["spec"], msg.get("ws"))
            res.update(op="done", id=msg["id"])
            write_frame(out, res)


if __name__ == "__main__":
    sys.exit(main())
