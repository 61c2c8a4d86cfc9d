"""JSON answers that close within their token budget.

A JSON-schema constrained answer cut by `max_tokens` is not a document at all. In the last tokens of its budget
(`window`: at most `--json-close-reserve`, at most a quarter of max_tokens) a JSON request samples only among the
tokens that close what is open, wherever its grammar allows one. Inside a string (`in_string`, a scan of the
answer's bytes): tokens that end it, `"` followed only by `]`/`}` first, then `"` alone. Outside: tokens of `]`/`}`
only (end an array or object), else tokens of `"` only (`""`: an empty string where a string value must come).
Where the grammar allows none of them (a required key, a digit a pattern needs) the model chooses as usual under
the grammar. The answer still validates (the grammar mask stays), it is shorter than the model would have
written, and its finish_reason is `length`: the budget ended it (runtime/scheduler/finish.py). A request whose
choices this never narrowed finishes as before.

Data flow: ResultProcessor._sample -> apply_grammar_masks (disallowed logits -inf) -> `Closers.restrict` on the
rows in their window ([B, V] logits, in place) -> sample.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

QUOTE, ENDS = ord('"'), frozenset(b"]}")


def window(max_new_tokens: int, reserve: int) -> int:
    """How many final tokens of a `max_new_tokens` budget close the document (0: never)."""
    return min(reserve, max_new_tokens // 4)


_ESCAPE = re.compile(rb"\\.", re.S)  # a backslash and the byte it escapes


def in_string(text: bytes) -> bool:
    """Whether a JSON text (a prefix of one) ends inside a string. Backslashes occur only inside strings and
    escape one byte each (`\\uXXXX`: its hex digits are no quotes), so once the escape pairs are gone the
    quotes left alternate open/close. In C (re, bytes.count): the window scans the whole answer every step."""
    return _ESCAPE.sub(b"", text).count(b'"') % 2 == 1


class Closers:
    """Token classes of the vocabulary: `ends` ]/} only; `quotes` " only; `quote_ends` one " then ]/} only
    (special tokens' texts fall in none)."""

    def __init__(self, vocab_size: int, token_bytes: Callable[[int], bytes]):
        self.ends, self.quotes, self.quote_ends = (torch.zeros(vocab_size, dtype=torch.bool) for _ in range(3))
        for i in range(vocab_size):
            b = token_bytes(i)
            if not b:
                continue
            if set(b) <= ENDS:
                self.ends[i] = True
            elif set(b) == {QUOTE}:
                self.quotes[i] = True
            elif b[0] == QUOTE and set(b[1:]) <= ENDS:
                self.quote_ends[i] = True

    def restrict(self, logits: torch.Tensor, rows: list[int], inside: list[bool]) -> list[bool]:
        """In place on logits [B, V] (grammar mask applied: disallowed = -inf), for each of `rows` (`inside`: it
        ends inside a string): keep only its allowed tokens of the first class it has, in the order of the
        module docstring. Returns, per row, whether that removed an allowed token."""
        dev = logits.device
        idx = torch.tensor(rows, device=dev)
        sub = logits[idx]
        allowed = sub > float("-inf")  # [R, V]
        ins = torch.tensor(inside, device=dev)[:, None]
        first = allowed & torch.where(ins, self.quote_ends.to(dev), self.ends.to(dev))
        second = allowed & self.quotes.to(dev)
        keep = torch.where(first.any(1, keepdim=True), first,
                           torch.where(second.any(1, keepdim=True), second, allowed))
        logits[idx] = sub.masked_fill(~keep, float("-inf"))
        return (allowed & ~keep).any(dim=1).tolist()
