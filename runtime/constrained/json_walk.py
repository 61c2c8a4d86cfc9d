"""The subschemas of a JSON schema node, by keyword (one place for every rewrite's and check's walk)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas", "dependencies")
SUBSCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
                 "additionalItems", "unevaluatedItems", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def children(s: dict) -> Iterator[tuple[str, dict]]:
    """(JSON-pointer suffix from `s`, subschema) for every subschema `s` holds directly (property values, items,
    branches, definitions...), dicts only (`dependencies` values that are lists of names are not schemas)."""
    for k in SUBSCHEMA_MAPS:
        if isinstance(s.get(k), dict):
            yield from ((f"{k}/{n}", x) for n, x in s[k].items() if isinstance(x, dict))
    for k in SUBSCHEMA_ONE:
        v = s.get(k)
        if isinstance(v, dict):
            yield k, v
        elif isinstance(v, list):  # draft-04 tuple `items`
            yield from ((f"{k}/{i}", x) for i, x in enumerate(v) if isinstance(x, dict))
    for k in SUBSCHEMA_LISTS:
        if isinstance(s.get(k), list):
            yield from ((f"{k}/{i}", x) for i, x in enumerate(s[k]) if isinstance(x, dict))


def subschemas(s: dict) -> list[Any]:
    """Every subschema `s` holds directly (see `children`)."""
    return [x for _, x in children(s)]
