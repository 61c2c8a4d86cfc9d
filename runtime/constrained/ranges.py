"""Regexes for integer and number ranges (JSON schema minimum/maximum, exclusive bounds), for the outlines
backend's schema-to-regex translation (runtime/constrained/schema.py): outlines-core itself ignores the bounds."""

from __future__ import annotations

import json
import math

from runtime.constrained.errors import fail as _fail


def _group(s: str) -> str:
    return f"(?:{s})" if "|" in s else s


def _cls(a: int, b: int) -> str:
    return str(a) if a == b else f"[{a}-{b}]"


def _same_len(lo: str, hi: str) -> str:
    """Regex for decimal strings of len(lo) == len(hi) digits within [lo, hi] (lo <= hi)."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return _cls(int(lo), int(hi))
    if lo[0] == hi[0]:
        return lo[0] + _group(_same_len(lo[1:], hi[1:]))
    rest = len(lo) - 1
    parts = []
    start = int(lo[0])
    if lo[1:] != "0" * rest:
        parts.append(lo[0] + _group(_same_len(lo[1:], "9" * rest)))
        start += 1
    end = int(hi[0]) if hi[1:] == "9" * rest else int(hi[0]) - 1
    if start <= end:
        parts.append(_cls(start, end) + ("[0-9]" if rest == 1 else f"[0-9]{{{rest}}}"))
    if hi[1:] != "9" * rest:
        parts.append(hi[0] + _group(_same_len("0" * rest, hi[1:])))
    return "|".join(parts)


def _nonneg_range(lo: int, hi: int | None) -> str:
    """Canonical decimal integers (no leading zeros) in [lo, hi], 0 <= lo; hi None = unbounded."""
    parts = []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    for d in range(len(str(lo)), len(str(top)) + 1):
        a = max(lo, 10 ** (d - 1) if d > 1 else 0)
        b = min(top, 10**d - 1)
        if a <= b:
            parts.append(_same_len(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return "|".join(parts)


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """Regex for JSON integers n with lo <= n <= hi (None = unbounded). Requires lo <= hi when both given."""
    parts = []
    if hi is None or hi >= 0:
        parts.append(_nonneg_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:  # negatives -m, m in [max(1, -hi), -lo]
        m_lo = max(1, -hi) if hi is not None else 1
        m_hi = -lo if lo is not None else None
        if m_hi is None or m_lo <= m_hi:
            parts.append("-" + _group(_nonneg_range(m_lo, m_hi)))
    return "(?:" + "|".join(parts) + ")"


def _int_bounds(s: dict, integer: bool) -> tuple[int | None, int | None, float | None, float | None]:
    """(a, b): the integer range, plus the real bounds (lo, hi) for fractional numbers (inclusive/exclusive
    folded into integers conservatively)."""
    lo = s.get("minimum")
    hi = s.get("maximum")
    xlo = s.get("exclusiveMinimum")
    xhi = s.get("exclusiveMaximum")
    a = b = None
    if lo is not None:
        a = math.ceil(lo)
    if xlo is not None and not isinstance(xlo, bool):
        a2 = math.floor(xlo) + 1
        a = a2 if a is None else max(a, a2)
    if hi is not None:
        b = math.floor(hi)
    if xhi is not None and not isinstance(xhi, bool):
        b2 = math.ceil(xhi) - 1
        b = b2 if b is None else min(b, b2)
    return a, b, lo, hi


def number_range_regex(s: dict, integer: bool) -> str:
    """A sound regex for the range: exact for integers; for numbers, integers in range plus k.f (f != 0) where
    the whole open interval (k, k+1) lies in the range."""
    a, b, _, _ = _int_bounds(s, integer)
    parts = []
    if a is None or b is None or a <= b:
        parts.append(int_range_regex(a, b))
    if not integer:
        reals = [x for x in (s.get("minimum"), s.get("exclusiveMinimum")) if isinstance(x, (int, float))
                 and not isinstance(x, bool)]
        lo = max(reals) if reals else None
        reals = [x for x in (s.get("maximum"), s.get("exclusiveMaximum")) if isinstance(x, (int, float))
                 and not isinstance(x, bool)]
        hi = min(reals) if reals else None
        frac = r"\.[0-9]{0,14}[1-9]"
        k_lo = max(math.ceil(lo), 0) if lo is not None else 0  # v in (k, k+1): k >= lo, k + 1 <= hi
        k_hi = math.floor(hi) - 1 if hi is not None else None
        if k_hi is None or k_lo <= k_hi:
            parts.append(_group(_nonneg_range(k_lo, k_hi)) + frac)
        m_lo = max(1, math.ceil(-hi)) if hi is not None else 1  # v in (-(m+1), -m): m + 1 <= -lo, m >= -hi
        m_hi = math.floor(-lo) - 1 if lo is not None else None
        if m_hi is None or m_lo <= m_hi:
            parts.append("-" + _group(_nonneg_range(m_lo, m_hi)) + frac)
        if (lo is None or lo <= -1) and (hi is None or hi >= 0):
            parts.append("-0" + frac)
    if not parts:
        _fail(f"unsatisfiable numeric range in schema: {json.dumps(s)[:200]}")
    return "(?:" + "|".join(parts) + ")"
