"""JSON-schema rules shared by the llguidance and xgrammar backends: parsing a schema under the draft it names,
bounding runaway values, and refusing keywords a backend would ignore.

Data flow: request schema text -> `parse_schema` (draft normalized to 2020-12) -> `bound_runaway_values` (and, on
llguidance, `bound_numbers`) -> `check_keywords` (xgrammar) -> the backend's own compiler.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.constrained.errors import fail as _fail
from runtime.constrained.json_any import bound_free_values, free_root
from runtime.constrained.json_caps import VALIDATION_KEYWORDS, Caps, cap_lengths, plan
from runtime.constrained.json_equiv import equivalent_forms
from runtime.constrained.json_walk import children, subschemas


def nesting_depth(x: Any, limit: int) -> int:
    stack = [(x, 1)]
    deepest = 0
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return deepest


MAX_SAFE_INTEGER = 2**53 - 1  # I-JSON (RFC 7493): integers beyond this do not survive a JSON round trip

ANNOTATIONS = frozenset({"$defs", "definitions"})  # containers of subschemas, checked when referenced
MAX_SCHEMA_BYTES = 1 << 20  # llguidance / xgrammar bound their own work; this only bounds parsing
MAX_SCHEMA_DEPTH = 128


def parse_schema(spec: str) -> dict | bool:
    """A JSON schema text -> the schema, checked against the draft its `$schema` names (2020-12 by default),
    bounded in size and depth; draft-04 boolean exclusiveMinimum/exclusiveMaximum rewritten to numbers."""
    if len(spec.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES:
        _fail(f"json_schema is larger than {MAX_SCHEMA_BYTES} bytes", "grammar_too_complex")
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        _fail(f"json_schema is not valid JSON: {e}")
    if not isinstance(schema, (dict, bool)):
        _fail("json_schema must be a JSON object (or boolean)")
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        _fail(f"json_schema is nested deeper than {MAX_SCHEMA_DEPTH}", "grammar_too_complex")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        _fail(f"invalid JSON schema at {where}: {e.message}")
    if schema is False:
        _fail("json_schema `false` admits nothing")
    if not isinstance(schema, dict):
        return schema
    draft = str(schema.get("$schema", ""))
    return equivalent_forms(_normalize_draft(schema, any(f"draft-0{n}" in draft for n in (3, 4, 6, 7))))


def _normalize_draft(s: dict, ref_overrides: bool) -> dict:
    """In place, to 2020-12 meaning: draft-04 `exclusiveMaximum: true` (+ maximum) becomes
    `exclusiveMaximum: <number>`; with `ref_overrides` (drafts 04-07) the keywords beside a `$ref` are dropped,
    as those drafts ignore them (2019-09+ apply them)."""
    for x, b in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(s.get(x), bool):
            flag = s.pop(x)
            if flag and isinstance(s.get(b), (int, float)):
                s[x] = s.pop(b)
    if ref_overrides and "$ref" in s:
        for k in [k for k in s if k not in ("$ref", "$defs", "definitions")]:
            del s[k]
    for sub in subschemas(s):
        _normalize_draft(sub, ref_overrides)
    return s


# Longest valid value of a string format (RFC 5321 section 4.5.3.1: a 254-byte address path; RFC 1035: 253-byte
# host names; URIs past 2,000 characters are refused by common servers and browsers). RFC 3339 lets a time's
# fraction of a second run on (`12:00:00.25614270516273537696...`, seen at temperature 0.8); 64 characters keep
# 30+ fraction digits, past the nanoseconds any parser reads.
EMAIL_PARTS = "^[^@]{1,64}@[^@]{1,253}$"
FORMAT_MAX_LENGTH = {"email": 254, "idn-email": 254, "hostname": 253, "idn-hostname": 253, "uri": 2048,
                     "uri-reference": 2048, "iri": 2048, "iri-reference": 2048, "date-time": 64, "time": 64}


def bound_runaway_values(schema: dict | bool, enabled: bool = True, formats: bool = True,
                         closed_objects: bool = False, caps: Caps | None = None) -> dict | bool:
    """Give every integer without a bound the I-JSON range [-(2^53-1), 2^53-1] (at most 16 digits), and every
    string format with a standard length limit that limit as maxLength, so a sampled value cannot run on for
    the whole token budget. Values these bounds cut off are ones no consumer accepts. caps: default caps on
    strings and arrays without an explicit bound (runtime/constrained/json_caps.py: never below the schema's own
    minimum, never under not/if/oneOf; free-form values bounded at every level: runtime/constrained/json_any.py);
    formats=False (xgrammar): no format lengths.
    closed_objects: an object listing `properties` without additionalProperties/patternProperties gets
    `additionalProperties: false`, where no other subschema on the same instance (allOf branch, anyOf's parent,
    a $ref's siblings) names a key it does not list. In place."""
    if enabled and schema is True and caps is not None and caps.free_depth and (
            caps.max_string or caps.max_items or caps.max_properties):
        schema = free_root(caps)  # any JSON document, bounded as a free-form value (json_any)
    if not enabled or not isinstance(schema, dict):
        return schema
    where = plan(schema) if closed_objects or caps is not None else None
    if closed_objects and where is not None:
        for s in where.closable():
            s["additionalProperties"] = False
    if caps is not None and where is not None:  # after closing (a closed object needs no maxProperties); the plan
        # stays valid: closing adds no subschema and no key a plan reads; bounding free values types them (the
        # caps they hold are the ones cap_lengths would give) and adds subschemas the plan does not hold
        bound_free_values(where, caps)
        cap_lengths(schema, caps, FORMAT_MAX_LENGTH, where)
    stack = [schema]
    while stack:
        s = stack.pop()
        t = s.get("type")
        if t == "integer" or (isinstance(t, list) and "integer" in t and "number" not in t):
            if "minimum" not in s and "exclusiveMinimum" not in s:
                s["minimum"] = -MAX_SAFE_INTEGER
            if "maximum" not in s and "exclusiveMaximum" not in s:
                s["maximum"] = MAX_SAFE_INTEGER
        limit = FORMAT_MAX_LENGTH.get(s["format"]) if isinstance(s.get("format"), str) else None
        if formats and limit is not None and not isinstance(s.get("maxLength"), int):
            s["maxLength"] = limit
        if formats and s.get("format") in ("email", "idn-email") and "pattern" not in s:
            s["pattern"] = EMAIL_PARTS  # RFC 5321: a local part of at most 64 octets
        stack.extend(subschemas(s))
    return schema


def check_keywords(schema: dict | bool, supported: frozenset[str], formats: frozenset[str], backend: str,
                   lengths_with_patterns: bool = True) -> None:
    """Refuse (GrammarValidationError naming it) any keyword the backend would ignore, so no output it emits
    can fail validation because of it. lengths_with_patterns=False: minLength/maxLength next to a pattern or
    format is refused too (xgrammar drops the length there)."""
    if not isinstance(schema, dict):
        return
    stack: list[tuple[dict, str]] = [(schema, "#")]
    while stack:
        s, path = stack.pop()
        if not lengths_with_patterns and ("pattern" in s or "format" in s) and (
                "minLength" in s or "maxLength" in s):
            _fail(f"unsupported at {path}: minLength/maxLength together with pattern/format (the {backend} grammar "
                  "backend cannot enforce both)")
        for k, v in s.items():
            if k not in VALIDATION_KEYWORDS:
                continue
            if k not in supported:
                _fail(f"unsupported JSON schema keyword {k!r} at {path} (the {backend} grammar backend cannot "
                      "enforce it)")
            if k == "format" and v not in formats:
                _fail(f"unsupported JSON schema format {v!r} at {path} (the {backend} grammar backend cannot "
                      "enforce it)")
        stack.extend((x, f"{path}/{sub}") for sub, x in children(s))


# llguidance takes multipleOf 1e-10 (1e-12 is refused: "too many digits", the float's decimal expansion)
NUMBER_FRACTION_DIGITS = 10


def bound_numbers(schema: dict | bool, digits: int | None = None) -> dict | bool:
    """Give every `number` without multipleOf, enum or const the bound `multipleOf: 10^-digits` (default
    NUMBER_FRACTION_DIGITS), which llguidance compiles as "at most `digits` fraction digits, no exponent", and,
    where it has no lower (upper) bound, the I-JSON limit -(2^53-1) (2^53-1) as integers get: a sampled number
    cannot run on in its fraction or its integer part for the whole token budget. (Integers are bounded by
    bound_runaway_values.) In place; only for backends that enforce a decimal multipleOf this way (llguidance;
    xgrammar refuses multipleOf)."""
    if not isinstance(schema, dict):
        return schema
    step = float(f"1e-{NUMBER_FRACTION_DIGITS if digits is None else digits}")
    stack = [schema]
    while stack:
        s = stack.pop()
        t = s.get("type")
        if (t == "number" or (isinstance(t, list) and "number" in t)) and not any(
                k in s for k in ("multipleOf", "enum", "const")):
            s["multipleOf"] = step
            if "minimum" not in s and "exclusiveMinimum" not in s:
                s["minimum"] = -MAX_SAFE_INTEGER
            if "maximum" not in s and "exclusiveMaximum" not in s:
                s["maximum"] = MAX_SAFE_INTEGER
        stack.extend(subschemas(s))
    return schema
