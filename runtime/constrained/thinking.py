"""Think first, then follow the grammar: a `Grammar` that lets a reasoning model's thinking through unmasked and
applies the request's constraint from the end-of-thinking marker on.

A request carries `think_end` (e.g. `</think>`) and optionally `think_start` (`<think>`) and `thinking_budget`
(runtime/sampling/params.py). Phases, a function of the accepted tokens (so rollback is exact):
- open (only with `think_start`, before the first token): the model may open its thinking (tokens spelling a
  prefix of `think_start`) or answer at once: then the inner grammar's tokens, masked from the first one;
- opening: only tokens continuing `think_start`;
- think: every token but EOS and the tokens that would complete `think_end` with anything but whitespace after it
  in the same token (so the answer begins exactly after the marker); once `cap` thinking tokens are spent, only
  tokens continuing `think_end` (and jump-forward appends the rest of the marker at once);
- answer: the inner grammar (None: anything), from its initial state; before its first token up to
  `MAX_GAP_TOKENS` whitespace-only tokens may separate it from the marker (`</think>\n\n{...}`, as models
  write it; the reasoning parser strips that whitespace from the answer).
Markers are matched on token bytes with a KMP automaton, so any tokenization of a marker (one added token, or
pieces; a jump-forward re-tokenization) is recognised.

`cap` = thinking_budget, and for a constrained request at most max_new_tokens minus the answer's room (half the
budget, at most 256 tokens: `answer_room`), so the answer always has tokens to complete in and still validates.
`free_prefix` (tokens before the answer; None while thinking) tells the closing window
(runtime/constrained/closing.py) to act only on the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from runtime.constrained.seam import Grammar

OPEN, OPENING, THINK, ANSWER = range(4)
MAX_ANSWER_ROOM = 256
MAX_GAP_TOKENS = 2


def answer_room(max_new_tokens: int) -> int:
    """Tokens a constrained thinking request keeps for its answer."""
    return min(max_new_tokens // 2, MAX_ANSWER_ROOM)


def _failure(marker: bytes) -> list[int]:
    fail = [0] * len(marker)
    k = 0
    for i in range(1, len(marker)):
        while k and marker[i] != marker[k]:
            k = fail[k - 1]
        if marker[i] == marker[k]:
            k += 1
        fail[i] = k
    return fail


class Marker:
    """A marker's automaton over the vocabulary: `advance(k, bytes)` and per-progress token masks."""

    def __init__(self, marker: bytes, token_bytes: Sequence[bytes | None], vocab_size: int) -> None:
        self.text = marker
        self._fail = _failure(marker)
        n = len(marker)
        # tokens that can matter: those holding the marker's last byte (may complete it) or inside it (continue it)
        cands = [(i, b) for i, b in enumerate(token_bytes[:vocab_size]) if b and (marker[-1:] in b or b in marker)]
        self.bad = torch.zeros(n, vocab_size, dtype=torch.bool)  # completes with non-whitespace after it
        self.cont = torch.zeros(n, vocab_size, dtype=torch.bool)  # spells marker[k:] (or a prefix of it)
        for k in range(n):
            rest = marker[k:]
            for i, b in cands:
                if rest.startswith(b) or (b.startswith(rest) and not b[len(rest):].strip()):
                    self.cont[k, i] = True
                _, after = self.advance(k, b)
                if after is not None and after.strip():
                    self.bad[k, i] = True
        self.cont_bits = [_pack(self.cont[k]) for k in range(n)]  # int32 [n][W]
        self.think_bits = [_pack(~self.bad[k]) for k in range(n)]

    def advance(self, k: int, data: bytes) -> tuple[int, bytes | None]:
        """(progress after `data` from progress k, the bytes after the first completion or None)."""
        m = self.text
        for j, c in enumerate(data):
            while k and c != m[k]:
                k = self._fail[k - 1]
            if c == m[k]:
                k += 1
                if k == len(m):
                    return 0, data[j + 1:]
        return k, None


class ThinkingVocab:
    """The vocabulary's token bytes and the marker automatons built from them (cached per marker)."""

    def __init__(self, token_bytes: Callable[[int], bytes], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bytes: list[bytes | None] = [_token_bytes(token_bytes, i) for i in range(vocab_size)]
        self.all_bits = _pack(torch.ones(vocab_size, dtype=torch.bool))
        self.space = torch.tensor([b is not None and b != b"" and not b.strip() for b in self.bytes], dtype=torch.bool)
        self.space_bits = _pack(self.space)
        self._markers: dict[bytes, Marker] = {}

    def marker(self, text: str) -> Marker:
        key = text.encode("utf-8")
        if key not in self._markers:
            self._markers[key] = Marker(key, self.bytes, self.vocab_size)
        return self._markers[key]


def _token_bytes(fn: Callable[[int], bytes], i: int) -> bytes | None:
    try:
        return fn(i)
    except (IndexError, KeyError, ValueError):  # logits rows past the tokenizer's vocabulary
        return None


class _State(NamedTuple):
    phase: int
    k: int  # progress along the current marker (opening: think_start, think: think_end); answer: gap tokens
    thought: int  # thinking tokens so far
    inner_n: int  # tokens the inner grammar has accepted
    answer_at: int  # output tokens before the answer (valid in ANSWER)
    tid: int = -1  # the token that led here (-1: the initial state)
    ended: bool = False  # EOS accepted (answer phase without an inner grammar)


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """bool [V] -> int32 [ceil(V / 32)] bitmask (bit j of word w = token 32*w + j)."""
    v = mask.shape[0]
    padded = torch.zeros((v + 31) // 32 * 32, dtype=torch.int64)
    padded[:v] = mask.to(torch.int64)
    return (padded.view(-1, 32) << torch.arange(32)).sum(1).to(torch.int32)


def _bit(i: int) -> int:
    b = 1 << (i & 31)
    return b - (1 << 32) if b >= 1 << 31 else b  # as a signed int32


class ThinkingGrammar(Grammar):
    """See the module docstring. `inner` is owned (a fresh copy per request). `_states[i]` is the state after the
    first i accepted tokens, so rollback pops states and rolls the inner grammar back by what it had taken."""

    def __init__(self, inner: Grammar | None, vocab: ThinkingVocab, eos_ids: frozenset[int], think_end: str,
                 think_start: str | None = None, cap: int | None = None) -> None:
        self.inner, self.vocab, self.eos_ids, self.cap = inner, vocab, eos_ids, cap
        self.vocab_size = inner.vocab_size if inner is not None else vocab.vocab_size
        self.end = vocab.marker(think_end)
        self.start = vocab.marker(think_start) if think_start else None
        self._states = [_State(OPEN if self.start is not None else THINK, 0, 0, 0, 0)]

    def copy(self) -> ThinkingGrammar:
        return ThinkingGrammar(self.inner.copy() if self.inner is not None else None, self.vocab, self.eos_ids,
                               self.end.text.decode(), self.start.text.decode() if self.start else None, self.cap)

    @property
    def num_accepted(self) -> int:
        return len(self._states) - 1

    @property
    def free_prefix(self) -> int | None:
        s = self._states[-1]
        return s.answer_at if s.phase == ANSWER else (0 if s.phase == OPEN else None)

    def _forcing(self, s: _State) -> bool:
        return s.phase == THINK and self.cap is not None and s.thought >= self.cap

    def _gap_open(self, s: _State) -> bool:
        """Whitespace may still come between the marker and the answer."""
        return s.phase == ANSWER and s.answer_at > 0 and s.inner_n == 0 and s.k < MAX_GAP_TOKENS

    # ------------------------------------------------------------ advancing

    def accept_token(self, token_id: int) -> None:
        s = self._states[-1]
        b = self.vocab.bytes[token_id] if 0 <= token_id < self.vocab.vocab_size else None
        nxt = self._next(s, token_id, b or b"")
        if nxt is None:
            raise ValueError(f"token {token_id} is not allowed here (thinking grammar, phase {s.phase})")
        self._states.append(nxt._replace(tid=token_id))

    def _next(self, s: _State, tid: int, b: bytes) -> _State | None:
        n = len(self._states) - 1  # output tokens before this one
        if s.ended:
            return None
        if s.phase == OPEN:
            assert self.start is not None
            if b and tid not in self.eos_ids and self.start.text.startswith(b):
                k = len(b)
                return _State(THINK, 0, 0, 0, 0) if k == len(self.start.text) else _State(OPENING, k, 0, 0, 0)
            return self._answer_token(_State(ANSWER, 0, 0, 0, n), tid)
        if s.phase == OPENING:
            assert self.start is not None
            if not b or tid in self.eos_ids or not self.start.text[s.k:].startswith(b):
                return None
            k = s.k + len(b)
            return _State(THINK, 0, 0, 0, 0) if k == len(self.start.text) else _State(OPENING, k, 0, 0, 0)
        if s.phase == THINK:
            if tid in self.eos_ids or (self._forcing(s) and not self.end.cont[s.k, tid]):
                return None
            k, after = self.end.advance(s.k, b)
            if after is None:
                return _State(THINK, k, s.thought + 1, 0, 0)
            if after.strip():
                return None
            return _State(ANSWER, 0, s.thought + 1, 0, n + 1)
        return self._answer_token(s, tid)

    def _answer_token(self, s: _State, tid: int) -> _State | None:
        if self._gap_open(s) and tid not in self.eos_ids and self.vocab.space[tid]:
            return s._replace(k=s.k + 1)
        if self.inner is None:
            return s._replace(ended=tid in self.eos_ids)
        try:
            self.inner.accept_token(tid)
        except ValueError:
            return None
        return s._replace(inner_n=s.inner_n + 1)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: only {self.num_accepted} accepted")
        undo = self._states[-1].inner_n - self._states[-1 - n].inner_n
        if undo and self.inner is not None:
            self.inner.rollback(undo)
        del self._states[-n:]

    def can_accept_after_rollback(self, n: int, token_ids: Sequence[int]) -> bool:
        if n > self.num_accepted:
            return False
        tail = [s.tid for s in self._states[len(self._states) - n:]]
        self.rollback(n)
        done = 0
        try:
            for t in token_ids:
                self.accept_token(t)
                done += 1
            return True
        except ValueError:
            return False
        finally:
            self.rollback(done)
            for t in tail:
                self.accept_token(t)

    def is_terminated(self) -> bool:
        s = self._states[-1]
        if s.phase != ANSWER:
            return False
        return s.ended if self.inner is None else self.inner.is_terminated()

    def jump_forward(self) -> str | None:
        s = self._states[-1]
        forced = b""
        if s.phase == OPENING:
            assert self.start is not None
            forced = self.start.text[s.k:]
        elif self._forcing(s):
            forced = self.end.text[s.k:]
        elif s.phase == ANSWER and self.inner is not None:
            return self.inner.jump_forward()
        try:
            return forced.decode("utf-8") or None
        except UnicodeDecodeError:  # the marker cut inside a character: decode it token by token
            return None

    # ------------------------------------------------------------ masks

    def write_bitmask(self, row: torch.Tensor) -> None:
        s = self._states[-1]
        if s.phase in (OPEN, ANSWER):
            if s.ended:
                row.zero_()
            elif self.inner is not None:
                self.inner.write_bitmask(row)  # its EOS bits are its own: set exactly where it may end
            else:
                _put(row, self.vocab.all_bits)
            extra = self.start.cont_bits[0] if s.phase == OPEN and self.start else None
            if self._gap_open(s):
                extra = self.vocab.space_bits
            if extra is not None:
                w = min(row.shape[0], extra.shape[0])
                row[:w] |= extra[:w]
            return
        if s.phase == OPENING:
            assert self.start is not None
            _put(row, self.start.cont_bits[s.k])
        elif self._forcing(s):
            _put(row, self.end.cont_bits[s.k])
        else:
            _put(row, self.end.think_bits[s.k])
        for e in self.eos_ids:  # no EOS before the answer
            if e >> 5 < row.shape[0]:
                row[e >> 5] &= ~_bit(e)

    # ------------------------------------------------------------ helpers for tests and tools

    def allowed_tokens(self) -> list[int]:
        row = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self.write_bitmask(row)
        bits = (row.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
        return bits.flatten()[: self.vocab_size].nonzero().flatten().tolist()

    def accept_tokens(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            self.accept_token(t)

    def can_accept(self, token_ids: Sequence[int]) -> bool:
        return self.can_accept_after_rollback(0, token_ids)


def _put(row: torch.Tensor, bits: torch.Tensor) -> None:
    """row (int32 [W]) = bits, zero-padded or cut to W words."""
    row.zero_()
    w = min(row.shape[0], bits.shape[0])
    row[:w] = bits[:w]


def wrap_thinking(inner: Grammar | None, vocab: ThinkingVocab, eos_ids: frozenset[int], think_end: str,
                  think_start: str | None, budget: int | None, max_new_tokens: int) -> ThinkingGrammar:
    """The request's grammar for a thinking request (`inner`: its compiled constraint's fresh copy, or None)."""
    cap = budget
    if inner is not None:
        room_cap = max(max_new_tokens - answer_room(max_new_tokens) - len(think_end.encode()), 0)
        cap = room_cap if cap is None else min(cap, room_cap)
    return ThinkingGrammar(inner, vocab, eos_ids, think_end, think_start, cap)
