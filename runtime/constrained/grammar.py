"""Per-request grammar state over a compiled outlines-core Index, batched masks, and jump-forward.

Data flow each decode step (scheduler side):
    apply_grammar_masks(logits[B, V], [req.grammar or None ...])   # one bitmask for the constrained rows only
    sample -> token ids
    req.grammar.accept_token(tid); finished if req.grammar.is_terminated()
    plan = plan_jump_forward(req.grammar, req.output_ids, tok.token_bytes, encode)   # optional
    if plan: drop plan.rollback trailing tokens (their KV), append plan.new_ids (computed as an extend),
             req.grammar.replace_tail(plan.rollback, plan.new_ids)

Invariants:
- `CompiledGrammar` is immutable and shared by every request with the same (kind, spec); per-state caches on
  it (forced jump-forward bytes) are pure functions of the Index, so sharing them is safe.
- A `Grammar` holds the DFA state history (`_states[0]` is the initial state, one entry per accepted token),
  so `rollback(n)` is exact for any n <= tokens accepted.
- EOS ids are masked in only in accepting states; accepting EOS terminates the grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from outlines_core import Guide, Index

MAX_JUMP_BYTES = 512  # longest forced string returned by one jump_forward()


class CompiledGrammar:
    """One compiled constraint: the Index plus vocabulary facts needed for masks and jump-forward."""

    def __init__(self, index: Index, key: tuple[str, str], regex: str, eos_ids: frozenset[int],
                 single_byte_ids: dict[int, int], first_byte: Sequence[int], vocab_size: int) -> None:
        self.index = index
        self.key = key
        self.regex = regex
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self._single = single_byte_ids  # byte value -> the token id that is exactly that byte
        self._first_byte = first_byte  # token id -> first byte of its bytes (-1: none / special)
        self._forced: dict[int, tuple[bytes, int]] = {}  # state -> (forced bytes, state after them)
        self.initial_state = index.get_initial_state()

    def forced_from(self, state: int) -> tuple[bytes, int]:
        """The bytes every continuation from `state` must start with (stopping at accepting states), and the
        state after them. Exact when the vocabulary has a single-byte token for each byte it can emit."""
        hit = self._forced.get(state)
        if hit is not None:
            return hit
        out = bytearray()
        s = state
        while len(out) < MAX_JUMP_BYTES and not self.index.is_final_state(s):
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
        result = (bytes(out), s)
        self._forced[state] = result
        return result

    def new_state(self) -> Grammar:
        return Grammar(self)


class Grammar:
    """A request's position in one compiled grammar. `copy()` gives a fresh grammar at the initial state."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._guide: Guide | None = Guide(compiled.index)  # shares the Index (Arc); only writes masks
        self._states: list[int] = [compiled.initial_state]
        self._tokens: list[int] = []  # accepted non-EOS tokens; _states[i + 1] is the state after _tokens[i]
        self._eos_accepted = False

    # ------------------------------------------------------------ state

    def copy(self) -> Grammar:
        return Grammar(self.compiled)

    @property
    def state(self) -> int:
        return self._states[-1]

    @property
    def num_accepted(self) -> int:
        return len(self._states) - 1 + int(self._eos_accepted)

    def is_accepting(self) -> bool:
        return self.compiled.index.is_final_state(self.state)

    def allowed_tokens(self) -> list[int]:
        if self._eos_accepted:
            return []
        toks = [t for t in self.compiled.index.get_allowed_tokens(self.state) if t not in self.compiled.eos_ids]
        return toks + sorted(self.compiled.eos_ids) if self.is_accepting() else toks

    def accept_token(self, token_id: int) -> None:
        """Advance by one sampled token; ValueError if the grammar does not allow it."""
        if self._eos_accepted:
            raise ValueError(f"grammar already terminated; got token {token_id}")
        if token_id in self.compiled.eos_ids:
            if not self.is_accepting():
                raise ValueError(f"EOS token {token_id} is not allowed before the grammar is complete")
            self._eos_accepted = True
            return
        nxt = self.compiled.index.get_next_state(self.state, token_id)
        if nxt is None:
            raise ValueError(f"token {token_id} is not allowed by the grammar in state {self.state}")
        self._states.append(nxt)
        self._tokens.append(token_id)
        if self._guide is not None:
            self._guide.advance(token_id, return_tokens=False)

    def accept_tokens(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            self.accept_token(t)

    def can_accept(self, token_ids: Sequence[int]) -> bool:
        s = self.state
        idx = self.compiled.index
        for t in token_ids:
            if t in self.compiled.eos_ids:
                return False
            s = idx.get_next_state(s, t)
            if s is None:
                return False
        return True

    def can_accept_after_rollback(self, n: int, token_ids: Sequence[int]) -> bool:
        if n > len(self._states) - 1:
            return False
        s = self._states[len(self._states) - 1 - n]
        for t in token_ids:
            s = None if t in self.compiled.eos_ids else self.compiled.index.get_next_state(s, t)
            if s is None:
                return False
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (an accepted EOS counts as one)."""
        if n <= 0:
            return
        if self._eos_accepted:
            self._eos_accepted = False
            n -= 1
        if n > len(self._states) - 1:
            raise ValueError(f"cannot roll back {n} tokens: only {len(self._states) - 1} accepted")
        if n:
            del self._states[-n:]
            del self._tokens[-n:]
            self._guide = None

    def replace_tail(self, rollback: int, new_ids: Sequence[int]) -> None:
        """Jump-forward bookkeeping: drop `rollback` trailing tokens, then accept `new_ids`."""
        saved = list(self._states), list(self._tokens), self._eos_accepted
        self.rollback(rollback)
        try:
            self.accept_tokens(new_ids)
        except ValueError:
            self._states, self._tokens, self._eos_accepted = saved
            self._guide = None
            raise

    def advance_text(self, token_ids: Sequence[int]) -> None:
        """Re-init from the initial state and replay all of `token_ids` (the request's final output ids)."""
        self._states = [self.compiled.initial_state]
        self._tokens = []
        self._eos_accepted = False
        self._guide = Guide(self.compiled.index)
        self.accept_tokens(token_ids)

    def is_terminated(self) -> bool:
        """EOS accepted, or an accepting state from which nothing but EOS may follow."""
        if self._eos_accepted:
            return True
        if not self.is_accepting():
            return False
        return all(t in self.compiled.eos_ids for t in self.compiled.index.get_allowed_tokens(self.state))

    # ------------------------------------------------------------ masks

    def _guide_now(self) -> Guide:
        """The mask-writing Guide at the current state (rebuilt by replaying the tokens after a rollback)."""
        if self._guide is None:
            g = Guide(self.compiled.index)
            for t in self._tokens:
                g.advance(t, return_tokens=False)
            self._guide = g
        return self._guide

    def write_bitmask(self, row: torch.Tensor) -> None:
        """Write this grammar's allowed-token bitmask into `row` (int32 [W], contiguous CPU, W*32 >= vocab)."""
        if self._eos_accepted:
            row.zero_()
            for e in self.compiled.eos_ids:
                row[e >> 5] |= _bit(e)
            return
        self._guide_now().write_mask_into(row.data_ptr(), row.numel(), 4)
        if self.is_accepting():  # the Index knows one EOS id; allow them all
            for e in self.compiled.eos_ids:
                row[e >> 5] |= _bit(e)
        else:
            for e in self.compiled.eos_ids:
                row[e >> 5] &= ~_bit(e)

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        """Set `mask_row` (bool [V]) to the allowed tokens."""
        v = mask_row.shape[0]
        bm = torch.zeros((v + 31) // 32, dtype=torch.int32)
        self.write_bitmask(bm)
        mask_row.copy_(unpack_bitmask(bm.unsqueeze(0), v)[0])

    # ------------------------------------------------------------ jump-forward

    def jump_forward_bytes(self) -> bytes | None:
        """The forced bytes from the current state (not consumed), or None when the next byte is free."""
        if self._eos_accepted:
            return None
        forced, _ = self.compiled.forced_from(self.state)
        return forced or None

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


def _constrained_bitmask(grammars: Sequence[Grammar | None], vocab_size: int) -> tuple[list[int], torch.Tensor]:
    """(rows that have a grammar, their packed allowed-token bitmask int32 [len(rows), ceil(V / 32)])."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    bm = torch.zeros((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
    for j, i in enumerate(rows):
        grammars[i].write_bitmask(bm[j])
    return rows, bm


def fill_masks(grammars: Sequence[Grammar | None], mask: torch.Tensor) -> None:
    """mask: bool [B, V]; row i = allowed tokens of grammars[i] (all True where grammars[i] is None)."""
    mask.fill_(True)
    rows, bm = _constrained_bitmask(grammars, mask.shape[1])
    if rows:
        mask[torch.tensor(rows, device=mask.device)] = unpack_bitmask(bm, mask.shape[1]).to(mask.device)


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[Grammar | None]) -> None:
    """Set disallowed logits to -inf in place for rows with a grammar; rows without one are not touched and a
    batch without grammars costs one list scan."""
    if all(g is None for g in grammars):
        return
    v = logits.shape[1]
    rows, bm = _constrained_bitmask(grammars, v)
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
        if grammar._eos_accepted or not grammar.can_accept_after_rollback(rollback, fresh):
            continue
        return JumpPlan(rollback, list(fresh), forced)
    return None
