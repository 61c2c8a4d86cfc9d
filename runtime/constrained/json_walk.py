"""The subschemas of a JSON schema node, by keyword (one place for every rewrite's walk)."""

from __future__ import annotations

from typing import Any

SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
SUBSCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
                  "additionalItems", "unevaluatedItems", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def subschemas(s: dict) -> list[Any]:
    """Every subschema `s` holds directly (property values, items, branches, definitions...), dicts only."""
    out: list[Any] = []
    for k in SUBSCHEMA_MAPS:
        if isinstance(s.get(k), dict):
            out.extend(s[k].values())
    for k in SUBSCHEMA_ONE:
        v = s.get(k)
        out.extend(v if isinstance(v, list) else [v])
    for k in SUBSCHEMA_LISTS:
        if isinstance(s.get(k), list):
            out.extend(s[k])
    if isinstance(s.get("dependencies"), dict):
        out.extend(v for v in s["dependencies"].values() if isinstance(v, dict))
    return [x for x in out if isinstance(x, dict)]
