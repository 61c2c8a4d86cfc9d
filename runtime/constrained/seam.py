"""The grammar seam: everything the scheduler, the sampler, the speculator and jump-forward call on a
constrained request, and the backend interface that hands out grammars.

Data flow:
    BaseGrammarBackend.get_future(params) -> CompileFuture | None     (None: unconstrained; compiles off-thread)
    scheduler polls future.done(); future.result().copy() -> Req.grammar  (result() raises GrammarCompileError)
    each step: Grammar.fill_bitmasks (through grammar.apply_grammar_masks) -> sample -> accept_token(tid)
    finish: is_terminated()
    speculation: accept_token / write_bitmask per draft position, then rollback(n)
    jump-forward: jump_forward(), can_accept_after_rollback(n, ids), replace_tail(n, ids)

The compile pool (pool.py) implements BaseGrammarBackend; grammar.py's MatcherGrammar implements Grammar over a
backend matcher (llguidance, xgrammar, outlines); tests implement both with small fakes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from runtime.sampling.params import SamplingParams


class Grammar(ABC):
    """One request's position in a compiled constraint.

    Invariants every implementation keeps:
    - The state moves only through `accept_token` and `rollback`. `rollback(n)` undoes exactly the last n
      accepted tokens (an accepted EOS counts as one) for any n <= num_accepted.
    - `accept_token` of a token the grammar does not allow raises ValueError and leaves the state unchanged.
    - EOS is accepted only where the text so far is a complete match; after it nothing else is.
    - Bitmask rows are int32 words, bit j of word w = token 32*w + j, at least ceil(vocab_size / 32) words;
      a row's EOS bits are set exactly where EOS may be accepted.
    """

    vocab_size: int  # the grammar's vocabulary (its bitmask rows need ceil(vocab_size / 32) words)

    @abstractmethod
    def copy(self) -> Grammar:
        """A fresh grammar over the same compiled constraint, at the initial state (states are never shared)."""

    @property
    @abstractmethod
    def num_accepted(self) -> int:
        """Tokens accepted so far (an EOS counts as one)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> None:
        """Advance by one sampled token; ValueError (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens; ValueError if n > num_accepted."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """EOS accepted, or a complete match from which only EOS may follow: the request is done."""

    @abstractmethod
    def write_bitmask(self, row: torch.Tensor) -> None:
        """This grammar's allowed next tokens into `row` (int32 [W], contiguous CPU), every other bit cleared."""

    @abstractmethod
    def can_accept_after_rollback(self, n: int, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` would all be accepted after rolling back n tokens; the state is left unchanged."""

    @abstractmethod
    def jump_forward(self) -> str | None:
        """Text every continuation from here must start with (whole UTF-8 characters), or None if none is."""

    @property
    def free_prefix(self) -> int | None:
        """Output tokens before the constrained text (a thinking model's reasoning, runtime/constrained/thinking.py);
        None while the output is still free. Plain grammars constrain from the first token."""
        return 0

    def replace_tail(self, rollback: int, new_ids: Sequence[int]) -> None:
        """Jump-forward bookkeeping: drop `rollback` trailing tokens, then accept `new_ids`; all or nothing
        (ValueError with the state unchanged when the grammar does not accept them)."""
        if not self.can_accept_after_rollback(rollback, new_ids):
            raise ValueError("the grammar does not accept the jump-forward tokens")
        self.rollback(rollback)
        for t in new_ids:
            self.accept_token(t)

    @classmethod
    def fill_bitmasks(cls, grammars: Sequence[Grammar], bitmask: torch.Tensor) -> None:
        """Row k of `bitmask` (int32 [len(grammars), W], contiguous CPU) = the allowed tokens of grammars[k],
        all of them instances of `cls`. Implementations with a batched matcher API override this."""
        for k, g in enumerate(grammars):
            g.write_bitmask(bitmask[k])


class GrammarCompileError(ValueError):
    """A constraint that failed to compile (`code`: "invalid_value" or "grammar_too_complex") or timed out."""

    def __init__(self, message: str, code: str = "invalid_value", timed_out: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.timed_out = timed_out


class CompileFuture(Protocol):
    """One request's pending compile, polled by the scheduler every step (never blocks)."""

    def done(self) -> bool:
        """The compile has finished (successfully or not)."""
        ...

    def result(self) -> Grammar:
        """The compiled grammar (take `.copy()` for the request's own state); call only once `done()`.
        Raises GrammarCompileError for a failed or timed-out compile."""
        ...

    def cancel(self) -> None:
        """Drop interest: a compile nobody waits for is skipped if it has not started."""
        ...


class BaseGrammarBackend(ABC):
    """Hands out compiles of requests' constraints; owned by the scheduler process."""

    @abstractmethod
    def get_future(self, params: SamplingParams) -> CompileFuture | None:
        """Start (or share, or take from the cache) the compile of `params`' constraint; None when the request
        has no constraint."""

    def stats(self) -> dict[str, Any]:
        """Compile counters for /get_server_info and /metrics (SGLang's names where they exist)."""
        return {}

    def close(self) -> None:  # noqa: B027 (a backend without workers has nothing to stop)
        """Stop the compile workers."""
