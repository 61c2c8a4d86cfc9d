"""`MatcherGrammar`, the seam's `Grammar` (seam.py) over a backend matcher; batched masks; jump-forward planning.

Every backend (outlines_backend.py, llguidance_backend.py, xgrammar_backend.py) subclasses `MatcherGrammar` and
implements the few `_`-prefixed hooks. The scheduler side (runtime/scheduler/output.py, speculative.py) calls:
    apply_grammar_masks(logits[B, V], [req.grammar or None ...])   # one int32 bitmask for the constrained rows
    plan = plan_jump_forward(req.grammar, req.output_ids, tok.token_bytes, encode)   # optional
    if plan: drop plan.rollback trailing tokens, append plan.new_ids, req.grammar.replace_tail(...)

Invariants of MatcherGrammar (besides the seam's):
- `_tokens` holds the accepted non-EOS tokens in order; the backend matcher is always exactly at the state after
  them, so `rollback(n)` is exact for any n <= len(_tokens).
- EOS ids never reach the backend matcher: an EOS is accepted here only in an accepting state (then the grammar
  is terminated). In masks, EOS bits are set exactly in accepting states, whatever the backend wrote.
- Bitmask layout (all backends, llguidance's and xgrammar's own): int32 words, bit j of word w = token 32*w + j.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from runtime.constrained.seam import Grammar

MAX_JUMP_BYTES = 512  # longest forced string one jump_forward() returns


@dataclass(frozen=True)
class GrammarError:
    """A failed compile: `message` names the problem; `code` is "invalid_value" or "grammar_too_complex"."""

    message: str
    code: str = "invalid_value"
    timed_out: bool = False


@dataclass(frozen=True)
class VocabInfo:
    """What every backend needs to know about the model's vocabulary.
    tokens[i]: the bytes of token i (None: a special/control token or a hole); special[i]: a special token's text;
    encode(text) -> ids (plain text, no control tokens), for backends that re-tokenize forced text."""

    tokens: list[bytes | None]
    eos_ids: frozenset[int]
    special: dict[int, bytes]
    bos_id: int | None = None
    encode: Callable[[str], list[int]] | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)


class MatcherGrammar(Grammar):
    """The seam's Grammar over one backend matcher: EOS handling, token history and rollback live here; a backend
    implements the `_`-prefixed hooks, `is_accepting` and `copy`."""

    def __init__(self, eos_ids: frozenset[int], vocab_size: int) -> None:
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size  # the backend's vocabulary (bitmask words = ceil(vocab_size / 32))
        self._tokens: list[int] = []
        self._eos_accepted = False

    # ------------------------------------------------------------ backend hooks

    @abstractmethod
    def copy(self) -> MatcherGrammar: ...

    @abstractmethod
    def _consume(self, token_id: int) -> bool:
        """Advance the backend matcher by one non-EOS token; False (state unchanged) if it is not allowed."""

    @abstractmethod
    def _backtrack(self, n: int) -> None:
        """Undo the backend matcher's last n tokens."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS may follow)."""

    @abstractmethod
    def _only_eos_next(self) -> bool:
        """Accepting, and no non-EOS token may follow."""

    @abstractmethod
    def _forced_bytes(self) -> bytes:
        """Bytes every continuation from here must start with (may be empty)."""

    @abstractmethod
    def _write_row(self, row: torch.Tensor) -> None:
        """The backend's allowed-token bits into `row` (int32 [ceil(vocab_size / 32)], contiguous CPU)."""

    @classmethod
    def _fill_backend_rows(cls, grammars: Sequence[MatcherGrammar], bitmask: torch.Tensor) -> None:
        """Row k of `bitmask` (int32 [len(grammars), ceil(vocab_size / 32)], zeroed, contiguous CPU) = the
        backend bits of grammars[k] (none terminated). Backends with a batched API override this."""
        for k, g in enumerate(grammars):
            g._write_row(bitmask[k])

    @classmethod
    def fill_bitmasks(cls, grammars: Sequence[Grammar], bitmask: torch.Tensor) -> None:
        """The backend's bits for the live grammars (one batched call where the backend has one), then EOS bits
        set exactly in accepting states; a terminated grammar's row allows only EOS."""
        gs: list[MatcherGrammar] = [g for g in grammars if isinstance(g, MatcherGrammar)]
        assert len(gs) == len(grammars), "fill_bitmasks takes grammars of its own class"
        bitmask.zero_()
        live = [k for k, g in enumerate(gs) if not g._eos_accepted]
        words = (gs[0].vocab_size + 31) // 32 if gs else 0
        if len(live) == len(gs) and words == bitmask.shape[1] and bitmask.is_contiguous():
            cls._fill_backend_rows(gs, bitmask)
        elif live:
            part = torch.zeros(len(live), words, dtype=torch.int32)
            cls._fill_backend_rows([gs[k] for k in live], part)
            bitmask[torch.tensor(live), :words] = part
        for k, g in enumerate(gs):
            accepting = g._eos_accepted or g.is_accepting()
            for e in g.eos_ids:
                if accepting:
                    bitmask[k, e >> 5] |= _bit(e)
                else:
                    bitmask[k, e >> 5] &= ~_bit(e)

    # ------------------------------------------------------------ state

    @property
    def num_accepted(self) -> int:
        return len(self._tokens) + int(self._eos_accepted)

    @property
    def terminated(self) -> bool:
        """An EOS was accepted."""
        return self._eos_accepted

    def accept_token(self, token_id: int) -> None:
        """Advance by one sampled token; ValueError if the grammar does not allow it."""
        if self._eos_accepted:
            raise ValueError(f"grammar already terminated; got token {token_id}")
        if token_id in self.eos_ids:
            if not self.is_accepting():
                raise ValueError(f"EOS token {token_id} is not allowed before the grammar is complete")
            self._eos_accepted = True
            return
        if not self._consume(token_id):
            raise ValueError(f"token {token_id} is not allowed by the grammar here")
        self._tokens.append(token_id)

    def accept_tokens(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            self.accept_token(t)

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (an accepted EOS counts as one)."""
        if n <= 0:
            return
        if self._eos_accepted:
            self._eos_accepted = False
            n -= 1
        if n > len(self._tokens):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self._tokens)} accepted")
        if n:
            self._backtrack(n)
            del self._tokens[-n:]

    def can_accept_after_rollback(self, n: int, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` would be accepted after rolling back n tokens (the state is left unchanged)."""
        if self._eos_accepted or n > len(self._tokens) or any(t in self.eos_ids for t in token_ids):
            return False
        tail = self._tokens[len(self._tokens) - n:]
        self.rollback(n)
        done = 0
        try:
            for t in token_ids:
                if not self._consume(t):
                    break
                done += 1
            return done == len(token_ids)
        finally:
            if done:
                self._backtrack(done)
            for t in tail:
                if not self._consume(t):
                    raise RuntimeError("grammar could not replay its own tokens after a rollback")
            self._tokens.extend(tail)

    def can_accept(self, token_ids: Sequence[int]) -> bool:
        return self.can_accept_after_rollback(0, token_ids)

    def advance_text(self, token_ids: Sequence[int]) -> None:
        """Back to the initial state, then accept all of `token_ids` (a request's final output ids)."""
        self.rollback(self.num_accepted)
        self.accept_tokens(token_ids)

    def is_terminated(self) -> bool:
        """EOS accepted, or an accepting state from which nothing but EOS may follow."""
        return self._eos_accepted or self._only_eos_next()

    # ------------------------------------------------------------ masks

    def write_bitmask(self, row: torch.Tensor) -> None:
        """This grammar's allowed tokens into `row` (int32 [W], contiguous CPU, W*32 >= vocab_size)."""
        type(self).fill_bitmasks([self], row.view(1, -1))

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        """Set `mask_row` (bool [V]) to the allowed tokens."""
        v = mask_row.shape[0]
        bm = torch.zeros(1, (v + 31) // 32, dtype=torch.int32)
        _fill_rows([self], bm)
        mask_row.copy_(unpack_bitmask(bm, v)[0])

    def allowed_tokens(self) -> list[int]:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.fill_mask(mask)
        return mask.nonzero().flatten().tolist()

    # ------------------------------------------------------------ jump-forward

    def jump_forward_bytes(self) -> bytes | None:
        """The forced bytes from the current state (not consumed), or None when the next byte is free."""
        if self._eos_accepted:
            return None
        return self._forced_bytes()[:MAX_JUMP_BYTES] or None

    def jump_forward(self) -> str | None:
        """The forced continuation as text (cut to whole UTF-8 characters), or None if there is none."""
        forced = self.jump_forward_bytes()
        if not forced:
            return None
        for cut in range(len(forced), max(len(forced) - 4, 0), -1):
            try:
                return forced[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return None


def _bit(i: int) -> int:
    b = 1 << (i & 31)
    return b - (1 << 32) if b >= 1 << 31 else b  # as a signed int32


# ------------------------------------------------------------ batched masks


_POW = torch.tensor([_bit(j) for j in range(32)], dtype=torch.int32)  # 1 << j as int32


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, allowed: bool = True) -> torch.Tensor:
    """int32 [B, W] bitmask -> bool [B, vocab] (bit j of word w is token 32*w + j): the allowed tokens, or the
    disallowed ones with allowed=False (saves a negation pass)."""
    words = bitmask.unsqueeze(-1) & _POW.to(bitmask.device)
    bits = words != 0 if allowed else words == 0
    return bits.view(bitmask.shape[0], -1)[:, :vocab]


def _fill_rows(grammars: Sequence[Grammar], bitmask: torch.Tensor) -> None:
    """bitmask: int32 [len(grammars), W] (zeroed by this function). Rows are filled per grammar class with its
    `fill_bitmasks` (one batched call per backend)."""
    bitmask.zero_()
    groups: dict[type[Grammar], list[int]] = {}
    for k, g in enumerate(grammars):
        groups.setdefault(type(g), []).append(k)
    for cls, ks in groups.items():
        words = (grammars[ks[0]].vocab_size + 31) // 32
        if words > bitmask.shape[1]:
            raise ValueError(f"grammar vocabulary ({grammars[ks[0]].vocab_size}) is wider than the logits")
        if len(ks) == len(grammars) and words == bitmask.shape[1] and bitmask.is_contiguous():
            cls.fill_bitmasks(grammars, bitmask)
        else:
            part = torch.zeros(len(ks), words, dtype=torch.int32)
            cls.fill_bitmasks([grammars[k] for k in ks], part)
            bitmask[torch.tensor(ks), :words] = part


def _constrained_bitmask(grammars: Sequence[Grammar | None], vocab_size: int) -> tuple[list[int], torch.Tensor]:
    """(rows that have a grammar, their packed allowed-token bitmask int32 [len(rows), ceil(V / 32)])."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    bm = torch.zeros((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
    if rows:
        _fill_rows([g for g in grammars if g is not None], bm)  # the grammars of `rows`, in order
    return rows, bm


def fill_masks(grammars: Sequence[Grammar | None], mask: torch.Tensor) -> None:
    """mask: bool [B, V]; row i = allowed tokens of grammars[i] (all True where grammars[i] is None)."""
    mask.fill_(True)
    rows, bm = _constrained_bitmask(grammars, mask.shape[1])
    if rows:
        mask[torch.tensor(rows, device=mask.device)] = unpack_bitmask(bm, mask.shape[1]).to(mask.device)


def _native_mask(logits: torch.Tensor) -> bool:
    """Whether kernels/cpu's one-pass bitmask op can mask these logits: float32 CPU rows, and the native CPU
    extension already loaded in this process (the scheduler's model runner loads it; never built from here)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        return False
    from kernels.cpu import build

    return build.is_loaded()


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[Grammar | None]) -> None:
    """Set disallowed logits to -inf in place for rows with a grammar; rows without one are not touched and a
    batch without grammars costs one list scan. Float32 CPU logits go through kernels/cpu's one-pass op where
    it is loaded (32 rows of SmolLM2's 49,152 tokens: 0.9 instead of 7.8 ms per step, the backend's fill
    included), others through unpack_bitmask + masked_fill (the torch twin; tests/kernels/test_cpu_elementwise.py
    compares them)."""
    if all(g is None for g in grammars):
        return
    v = logits.shape[1]
    rows, bm = _constrained_bitmask(grammars, v)
    if _native_mask(logits):
        from kernels.cpu import ops

        ops.apply_token_bitmask_(logits, bm, None if len(rows) == logits.shape[0] else torch.tensor(rows))
        return
    banned = unpack_bitmask(bm.to(logits.device, non_blocking=True), v, allowed=False)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


# ------------------------------------------------------------ jump-forward re-tokenization


@dataclass(frozen=True)
class JumpPlan:
    """Replace the last `rollback` output tokens by `new_ids` (their text + the forced text, re-tokenized)."""

    rollback: int
    new_ids: list[int]
    forced: str


def plan_jump_forward(grammar: Grammar, output_ids: Sequence[int], token_bytes: Callable[[int], bytes],
                      encode: Callable[[str], list[int]], window: int = 4) -> JumpPlan | None:
    """Where the grammar forces text, re-tokenize the last <= `window` output tokens plus the forced text so the
    output is what the tokenizer would produce. Tokens shared with the old tail are kept (rollback counts only
    what changes). Returns None when nothing is forced or no re-tokenization is accepted by the grammar."""
    forced = grammar.jump_forward()
    if not forced:
        return None
    for k in range(min(window, len(output_ids), grammar.num_accepted), -1, -1):
        tail = list(output_ids[len(output_ids) - k:]) if k else []
        try:
            text = b"".join(token_bytes(t) for t in tail).decode("utf-8")
        except UnicodeDecodeError:
            continue
        new_ids = encode(text + forced)
        keep = 0
        while keep < min(len(tail), len(new_ids)) and tail[keep] == new_ids[keep]:
            keep += 1
        rollback, fresh = k - keep, new_ids[keep:]
        if not fresh:
            continue
        if not grammar.can_accept_after_rollback(rollback, fresh):
            continue
        return JumpPlan(rollback, list(fresh), forced)
    return None
