"""N-gram proposer ("prompt lookup decoding"): guess that the request continues as it did the last time its
current suffix appeared in its own tokens (prompt plus output).

For n from `max_n` down to `min_n`: take the last n tokens, find their most recent earlier occurrence
(a window that ends before the last token, so at least one continuation token exists), and propose the
tokens that followed it, up to k. Among the occurrences of one n, the most recent one with a full k-token
continuation wins, else the most recent. Longer matches are tried first; no match proposes nothing.

`propose_from_source` looks the suffix up in another sequence instead: a request's predicted output (OpenAI's
`prediction`), in which a cursor keeps the place, so text that repeats in a file (a closing brace, a common
line) continues where the answer is, not at its last occurrence.

Cost: one vectorised scan of the request's tokens per n (numpy, O(L * n)); the prompt's array is built once
per request and cached by the caller.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k proposed next tokens for the sequence `tokens` (int64 [L]); [] when no suffix of length
    min_n..max_n occurred earlier."""
    L = int(tokens.shape[0])
    if k <= 0 or L < 2:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        # windows start at j in [0, L - n): tokens[j : j + n], continuation from j + n <= L - 1
        windows = sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size == 0:
            continue
        full = hits[hits + n + k <= L]
        j = int(full[-1] if full.size else hits[-1])
        return tokens[j + n : j + n + k].tolist()
    return []


def propose_from_source(source: np.ndarray, tokens: np.ndarray, k: int, min_n: int, max_n: int,
                        cursor: int) -> tuple[list[int], int]:
    """Up to k tokens of `source` (int64 [S]) that follow an occurrence of a suffix of `tokens` (lengths max_n
    down to min_n), and the new cursor (the index in `source` where the proposal starts). Among the
    occurrences of one n, the first whose continuation starts at or after `cursor` wins, else the last one.
    ([], cursor) when no suffix occurs or nothing follows it."""
    S, L = int(source.shape[0]), int(tokens.shape[0])
    if k <= 0 or L == 0 or S < 2:
        return [], cursor
    for n in range(min(max_n, L, S - 1), min_n - 1, -1):
        windows = sliding_window_view(source[: S - 1], n)  # continuation from j + n <= S - 1
        hits = np.flatnonzero((windows == tokens[L - n :]).all(axis=1))
        if hits.size == 0:
            continue
        ahead = hits[hits + n >= cursor]
        j = int(ahead[0] if ahead.size else hits[-1])
        return source[j + n : j + n + k].tolist(), j + n
    return [], cursor
