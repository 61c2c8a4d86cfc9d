"""Marker scanning shared by the streaming parsers.

A streamed parser sees text in arbitrary pieces, so a marker such as `</think>` may arrive split (`</th` then
`ink>`). The rule every parser here follows: text that could still be the start of a marker is held back
(`held_suffix`) until the next piece decides; everything before it is final and may be emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


def held_suffix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `markers` (0: nothing to hold)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


def find_first(buf: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """(index, marker) of the earliest occurrence of any marker in `buf` (the longest one on a tie), or None."""
    found: tuple[int, str] | None = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (found is None or i < found[0] or (i == found[0] and len(m) > len(found[1]))):
            found = (i, m)
    return found


def split_trailing_space(s: str) -> tuple[str, str]:
    """(s without its trailing whitespace, that whitespace)."""
    core = s.rstrip()
    return core, s[len(core):]
