"""A parsed JSON schema rewritten into an *equal* schema in the keywords the grammar backends enforce.

Each rewrite keeps exactly the set of documents the schema accepts (never narrower, never wider), so it needs
none of the taint rules of the narrowing rewrites (runtime/constrained/json_caps.py) and runs first:
- `dependencies` / `dependentRequired` / `dependentSchemas` ("if key k is present, these keys are too / this
  schema holds") -> an allOf entry `anyOf: [{properties: {k: false}}, {required: [k, ...], allOf: [schema]}]`
  (both branches pass non-objects, as dependencies do);
- `not` of `required`, `type`, one property, `true`/`false`, and of allOf/anyOf/not of those (De Morgan) -> the
  positive form in the node's allOf (`not: {required: [a]}` is "an object without a": non-objects fail it);
- `format`: json-pointer, relative-json-pointer and uri-reference -> the pattern of their RFC (the backends have
  no grammar for them); a format no JSON Schema draft defines is an annotation (2020-12 validation, 7.2.3: an
  implementation MUST NOT fail validation due to an unknown format attribute) and is dropped. Formats a draft
  defines that no pattern here covers (iri, idn-hostname, regex, uri-template...) stay: the backend refuses
  them with a 400 naming the format;
- `oneOf` whose branches provably exclude each other -> `anyOf` (runtime/constrained/json_oneof.py), after the
  others so that its proof sees their positive forms.
What cannot be rewritten exactly stays as it was, and the backend refuses it naming the keyword.
"""

from __future__ import annotations

from typing import Any

from runtime.constrained.json_caps import VALIDATION_KEYWORDS
from runtime.constrained.json_oneof import TYPES, exclusive_branches
from runtime.constrained.json_walk import subschemas

# RFC 6901 JSON Pointer; relative JSON pointer (draft-handrews-relative-json-pointer-01, without the later
# index adjustments: a narrower set, every match valid).
_POINTER = r"(/([^/~]|~[01])*)*"
# RFC 3986 URI-reference = URI / relative-ref, from its ABNF; hosts are reg-names (an IPv4 address is one),
# IP-literals ("[v6]") are left out: a narrower set, every match valid.
_PCT = "%[0-9A-Fa-f]{2}"
_PCHAR = f"([A-Za-z0-9\\-._~!$&'()*+,;=:@]|{_PCT})"
_NOCOLON = f"([A-Za-z0-9\\-._~!$&'()*+,;=@]|{_PCT})"
_AUTHORITY = (f"(([A-Za-z0-9\\-._~!$&'()*+,;=:]|{_PCT})*@)?([A-Za-z0-9\\-._~!$&'()*+,;=]|{_PCT})*(:[0-9]*)?")
_TAIL = f"(\\?({_PCHAR}|[/?])*)?(#({_PCHAR}|[/?])*)?"
_ABEMPTY = f"(/{_PCHAR}*)*"
_ABSOLUTE = f"/({_PCHAR}+{_ABEMPTY})?"
_URI = f"[A-Za-z][A-Za-z0-9+\\-.]*:(//{_AUTHORITY}{_ABEMPTY}|{_ABSOLUTE}|{_PCHAR}+{_ABEMPTY}|){_TAIL}"
_RELATIVE = f"(//{_AUTHORITY}{_ABEMPTY}|{_ABSOLUTE}|{_NOCOLON}+{_ABEMPTY}|){_TAIL}"
FORMAT_PATTERNS = {
    "json-pointer": f"^{_POINTER}$",
    "relative-json-pointer": f"^(0|[1-9][0-9]*)(#|{_POINTER})$",
    "uri-reference": f"^({_URI}|{_RELATIVE})$",
}
# Formats the drafts define (03 to 2020-12); any other value is a custom, unknown format.
DEFINED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex", "utc-millisec", "color", "style", "phone", "ip-address", "host-name",
})


def _checks(s: dict) -> dict:
    """`s` without its annotations (what validation reads)."""
    return {k: v for k, v in s.items() if k in VALIDATION_KEYWORDS}


def negate(x: Any) -> Any:
    """A positive schema accepting exactly what `x` rejects, or None if none is built here."""
    if isinstance(x, bool):
        return not x
    if not isinstance(x, dict):
        return None
    checks = _checks(x)
    if not checks:
        return False
    if len(checks) > 1:  # independent keywords: not (A and B) = (not A) or (not B)
        if any(k in checks for k in ("additionalProperties", "patternProperties", "items", "additionalItems",
                                     "if", "then", "else", "contains", "unevaluatedProperties",
                                     "unevaluatedItems")):
            return None  # keywords whose meaning depends on a sibling
        parts = [negate({k: v}) for k, v in checks.items()]
        return None if any(p is None for p in parts) else {"anyOf": parts}
    (k, v), = checks.items()
    if k == "required" and isinstance(v, list):
        if not v:
            return False
        return {"type": "object", "anyOf": [{"properties": {key: False}} for key in v]}
    if k == "type":
        named = set(v if isinstance(v, list) else [v])
        if "integer" in named and "number" not in named:
            return None  # "a number with a fraction" has no positive keyword
        rest = [t for t in TYPES if t not in named and not (t == "number" and "integer" in named)]
        return {"type": rest} if rest else False
    if k == "properties" and isinstance(v, dict) and len(v) == 1:
        (key, sub), = v.items()
        neg = negate(sub)
        return None if neg is None else {"type": "object", "required": [key], "properties": {key: neg}}
    if k in ("allOf", "anyOf") and isinstance(v, list) and v:
        parts = [negate(b) for b in v]
        if any(p is None for p in parts):
            return None
        return {"anyOf" if k == "allOf" else "allOf": parts}
    if k == "not":
        return v
    return None


def _dependencies(s: dict) -> list[dict]:
    """`s`'s dependency keywords as allOf entries (removed from `s`); untouched if any is malformed."""
    required: dict[str, list] = {}
    schemas: dict[str, Any] = {}
    old = s.get("dependencies", {})
    for k, v in (old.items() if isinstance(old, dict) else ()):
        (required if isinstance(v, list) else schemas)[k] = v
    for key, into in (("dependentRequired", required), ("dependentSchemas", schemas)):
        if isinstance(s.get(key), dict):
            for k, v in s[key].items():
                if into.setdefault(k, v) is not v:  # a key both spellings name: left to the backend (a 400)
                    return []
    if not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in required.values()) or not all(
            isinstance(v, (bool, dict)) for v in schemas.values()):
        return []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        s.pop(key, None)
    out = [{"anyOf": [{"properties": {k: False}}, {"required": [k, *v]}]} for k, v in required.items()]
    for k, v in schemas.items():
        if v is not True:
            out.append({"anyOf": [{"properties": {k: False}}, {"required": [k], "allOf": [v]}]})
    return out


def _local(s: dict) -> None:
    """The rewrites of one node except oneOf, in place."""
    extra = _dependencies(s) if any(k in s for k in ("dependencies", "dependentRequired", "dependentSchemas")) else []
    if "not" in s:
        neg = negate(s["not"])
        if neg is not None:
            del s["not"]
            extra.append(neg)
    if extra:
        s["allOf"] = [*(s["allOf"] if isinstance(s.get("allOf"), list) else []), *extra]
    f = s.get("format")
    if isinstance(f, str):
        if f in FORMAT_PATTERNS and "pattern" not in s:
            s["pattern"] = FORMAT_PATTERNS[f]
            del s["format"]
        elif f not in DEFINED_FORMATS:
            del s["format"]


def equivalent_forms(root: dict) -> dict:
    """`root` (a parsed, draft-normalized schema) rewritten in place as described above."""
    stack, seen, nodes = [root], set(), []
    while stack:  # the local rewrites, then the subschemas they leave (new allOf entries included)
        s = stack.pop()
        if id(s) not in seen:
            seen.add(id(s))
            _local(s)
            nodes.append(s)
            stack.extend(subschemas(s))
    for s in nodes:
        if isinstance(s.get("oneOf"), list) and s["oneOf"]:
            branches = exclusive_branches(root, s)
            if branches is not None:
                del s["oneOf"]
                if "anyOf" in s:
                    s["allOf"] = [*(s["allOf"] if isinstance(s.get("allOf"), list) else []), {"anyOf": branches}]
                else:
                    s["anyOf"] = branches
    return root
