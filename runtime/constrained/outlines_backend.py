"""The outlines backend: a constraint becomes one regex (schema.py), compiled to an outlines-core Index (a
token-level DFA) in a killable subprocess (worker.py); a request's grammar is a DFA state history.

Kinds: regex, json_schema, choices. No ebnf or structural_tag (a 400 names them).
The Index crosses the process boundary as outlines-core's own binary serialization and is rebuilt with
`Index.from_binary` on the compile thread, never on the scheduler's.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import cast

import msgspec
import torch
from outlines_core import Guide, Index

from runtime.config import GrammarConfig
from runtime.constrained.errors import GrammarValidationError
from runtime.constrained.grammar import GrammarError, MatcherGrammar, VocabInfo
from runtime.constrained.schema import validate_outlines

WORKER_READY_TIMEOUT = 120.0  # seconds a fresh worker may take to import and build the vocabulary
_HEADER = struct.Struct(">I")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class OutlinesCompiled:
    """One compiled constraint: the Index plus vocabulary facts for jump-forward. Immutable and shared by every
    request with the same (kind, spec); its forced-bytes cache is a pure function of the Index."""

    def __init__(self, index: Index, regex: str, eos_ids: frozenset[int], single_byte_ids: dict[int, int],
                 first_byte: Sequence[int], vocab_size: int) -> None:
        self.index = index
        self.regex = regex
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self._single = single_byte_ids  # byte value -> the token id that is exactly that byte
        self._first_byte = first_byte  # token id -> first byte of its bytes (-1: none / special)
        self._forced: dict[int, bytes] = {}  # state -> forced bytes
        self.initial_state = index.get_initial_state()

    def forced_from(self, state: int) -> bytes:
        """The bytes every continuation from `state` must start with (stopping at accepting states). Exact when
        the vocabulary has a single-byte token for each byte it can emit."""
        hit = self._forced.get(state)
        if hit is not None:
            return hit
        out = bytearray()
        s = state
        while len(out) < 512 and not self.index.is_final_state(s):
            firsts = {self._first_byte[t] for t in self.index.get_allowed_tokens(s) if t not in self.eos_ids}
            if len(firsts) != 1:
                break
            b = firsts.pop()
            tid = self._single.get(b)
            nxt = None if tid is None or b < 0 else self.index.get_next_state(s, tid)
            if nxt is None:
                break
            out.append(b)
            s = nxt
        self._forced[state] = bytes(out)
        return self._forced[state]

    def new_state(self) -> OutlinesGrammar:
        return OutlinesGrammar(self)


class OutlinesGrammar(MatcherGrammar):
    """DFA state history: `_states[0]` is the initial state, `_states[i + 1]` the state after `_tokens[i]`."""

    def __init__(self, compiled: OutlinesCompiled) -> None:
        super().__init__(compiled.eos_ids, compiled.vocab_size)
        self.compiled = compiled
        self._guide: Guide | None = Guide(compiled.index)  # shares the Index (Arc); only writes masks
        self._states: list[int] = [compiled.initial_state]

    def copy(self) -> OutlinesGrammar:
        return OutlinesGrammar(self.compiled)

    @property
    def state(self) -> int:
        return self._states[-1]

    def _consume(self, token_id: int) -> bool:
        nxt = self.compiled.index.get_next_state(self.state, token_id)
        if nxt is None:
            return False
        self._states.append(nxt)
        if self._guide is not None:
            self._guide.advance(token_id, return_tokens=False)
        return True

    def _backtrack(self, n: int) -> None:
        del self._states[-n:]
        self._guide = None  # rebuilt by replay when a mask is next needed

    def is_accepting(self) -> bool:
        return bool(self.compiled.index.is_final_state(self.state))  # outlines_core has no type stubs

    def _only_eos_next(self) -> bool:
        if not self.is_accepting():
            return False
        return all(t in self.eos_ids for t in self.compiled.index.get_allowed_tokens(self.state))

    def _forced_bytes(self) -> bytes:
        return self.compiled.forced_from(self.state)

    def _write_row(self, row: torch.Tensor) -> None:
        if self._guide is None:
            g = Guide(self.compiled.index)
            for t in self._tokens:
                g.advance(t, return_tokens=False)
            self._guide = g
        self._guide.write_mask_into(row.data_ptr(), row.numel(), 4)


def validate(kind: str, spec: str, whitespace: str | None) -> None:
    """Server-process check: the regex conversion and its limits (GrammarValidationError names the problem)."""
    if kind in ("ebnf", "structural_tag"):
        raise GrammarValidationError(f"{kind} grammars are not supported by the outlines grammar backend "
                                     "(use --grammar-backend llguidance or xgrammar)")
    validate_outlines(kind, spec, whitespace)


class _Worker:
    """One compile subprocess, driven by one thread of the backend."""

    def __init__(self, init_frame: bytes) -> None:
        self._init = init_frame
        self.proc: subprocess.Popen | None = None
        self.crashed = False

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.constrained.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, env=env, cwd=_REPO_ROOT)
        assert self.proc.stdin is not None  # stdin=PIPE
        self.proc.stdin.write(self._init)
        self.proc.stdin.flush()
        ready = self._read(time.monotonic() + WORKER_READY_TIMEOUT)
        if ready is None or ready.get("op") != "ready":
            self.kill()
            raise RuntimeError("grammar compile worker failed to start")

    def _read(self, deadline: float) -> dict | None:
        """One frame, or None on timeout / EOF."""
        assert self.proc is not None and self.proc.stdout is not None  # a spawned worker; stdout=PIPE
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        need = _HEADER.size
        have_header = False
        while True:
            while len(buf) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
                chunk = os.read(fd, min(need - len(buf), 1 << 20))  # never past this frame
                if not chunk:
                    return None
                buf += chunk
            if have_header:
                return cast(dict, msgspec.msgpack.decode(bytes(buf[_HEADER.size:need])))  # frames are maps
            need = _HEADER.size + _HEADER.unpack(bytes(buf[:_HEADER.size]))[0]
            have_header = True

    def compile(self, job_id: int, kind: str, spec: str, ws: str | None, timeout: float) -> dict | None:
        """The worker's reply, or None when it ran past `timeout` (the process is killed) or died (then
        `self.crashed` is set)."""
        self.crashed = False
        if self.proc is None or self.proc.poll() is not None:
            self._spawn()
        assert self.proc is not None and self.proc.stdin is not None  # _spawn set it; stdin=PIPE
        data = msgspec.msgpack.encode({"op": "compile", "id": job_id, "kind": kind, "spec": spec, "ws": ws})
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            return None
        reply = self._read(time.monotonic() + timeout)
        if reply is None:
            self.crashed = self.proc.poll() is not None
            self.kill()
        return reply

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                assert f is not None  # both are pipes
                with contextlib.suppress(OSError):
                    f.close()
            self.proc = None


class OutlinesEngine:
    """Compiles in one killable subprocess per compile thread (the thread's `slot`): a runaway DFA build is
    SIGKILLed at `grammar_compile_timeout` and the worker respawned."""

    name = "outlines"
    kinds = ("regex", "json_schema", "choices")

    def __init__(self, vocab: VocabInfo, cfg: GrammarConfig) -> None:
        self.cfg = cfg
        self.eos_ids = vocab.eos_ids
        self.vocab_size = vocab.vocab_size
        clean = [None if (i in vocab.eos_ids or not b) else bytes(b) for i, b in enumerate(vocab.tokens)]
        self._single: dict[int, int] = {}
        self._first = [-1] * len(clean)
        for i, b in enumerate(clean):
            if b is not None:
                self._first[i] = b[0]
                if len(b) == 1:
                    self._single.setdefault(b[0], i)
        init = msgspec.msgpack.encode({"op": "init", "vocab": clean, "eos": min(vocab.eos_ids)})
        self._init_frame = _HEADER.pack(len(init)) + init
        self._next_id = 0

    def validate(self, kind: str, spec: str) -> None:
        validate(kind, spec, self.cfg.constrained_json_whitespace_pattern)

    def new_slot(self) -> _Worker:
        w = _Worker(self._init_frame)
        with contextlib.suppress(Exception):  # a failed spawn is retried at the first job
            w._spawn()
        return w

    def close_slot(self, slot: _Worker) -> None:
        slot.kill()

    def compile(self, slot: _Worker, kind: str, spec: str) -> tuple[OutlinesCompiled | GrammarError, int, str]:
        """(compiled or error, cache bytes, counter name: compiled / failed / timeouts / crashed)."""
        if kind not in self.kinds:
            try:
                self.validate(kind, spec)
            except GrammarValidationError as e:
                return GrammarError(str(e), e.code), 0, "failed"
        timeout = self.cfg.grammar_compile_timeout
        self._next_id += 1
        try:
            reply = slot.compile(self._next_id, kind, spec, self.cfg.constrained_json_whitespace_pattern, timeout)
        except Exception as e:  # noqa: BLE001 - spawn failure
            return GrammarError(f"grammar compile worker failed: {e}"), 0, "failed"
        if reply is None and slot.crashed:
            return GrammarError(f"grammar compile worker died compiling this {kind} (memory limit?)",
                                code="grammar_too_complex"), 0, "crashed"
        if reply is None:
            return GrammarError(f"grammar compilation timed out after {timeout:g}s ({kind} too complex)",
                                code="grammar_too_complex", timed_out=True), 0, "timeouts"
        if not reply["ok"]:
            return GrammarError(reply["error"], code=reply.get("code") or "invalid_value"), 0, "failed"
        blob = reply["index"]
        compiled = OutlinesCompiled(Index.from_binary(blob), reply["regex"], self.eos_ids, self._single,
                                    self._first, self.vocab_size)
        return compiled, len(blob), "compiled"
