"""Constraint specs -> one regex, with the limits that keep outlines-core's index build bounded.

`to_regex(kind, spec, whitespace)` is the single conversion used by both `validate` (server process, cheap) and
the compile worker (so a spec that validates compiles the very regex that was checked).

Kinds:
- "regex": the user's regex (Rust `regex` syntax as outlines-core reads it; a leading `^` / trailing `$` are
  dropped since the whole output must match anyway).
- "json_schema": a JSON schema -> regex via `outlines_core.json_schema.build_regex_from_schema` with a bounded
  whitespace pattern ("" = compact JSON by default). Sub-schemas outlines would get wrong or make explode are
  replaced by placeholders first and get our own regex: integers/numbers with ranges (outlines ignores
  minimum/maximum) and strings with minLength/maxLength (outlines' escape-aware `{m,n}` string regex makes
  the index build exponential in n: maxLength 16 took 15 s). Bounded strings therefore admit no escapes.
- "choices": a JSON list of strings -> an alternation of the escaped strings.

Limits (measured on SmolLM2's 49k vocabulary: `[a-z]{1,1000}` 1.4 s / 66 MB, `[a-z]{1,10000}` 20 s / 700 MB,
`[^"]{0,200}` 2.6 s / 111 MB, so the caps stop what certainly explodes and the compile timeout catches the rest):
- spec size <= MAX_SPEC_BYTES (64 KiB); converted regex <= MAX_REGEX_CHARS (256 Ki chars);
- JSON nesting depth of the schema document <= MAX_DEPTH (32); `enum` / choices <= MAX_ENUM (1024) entries;
- every repetition bound `{m,n}` (also maxLength/maxItems/minItems, which become bounds) <= MAX_REPEAT (1000),
  and the product of bounds along one nesting path <= MAX_REPEAT_PRODUCT (10000);
- `$ref` only local (`#...`) and never recursive; keywords outlines would silently ignore (multipleOf,
  uniqueItems, not, if/then/else, ...) are refused, so every output really validates.
Errors are `GrammarValidationError` (a ValueError) with `code` "invalid_value" or "grammar_too_complex".

Over the 400-line soft cap: one recursive translator over the JSON Schema keywords; splitting it by keyword
would scatter one recursion over several files.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

MAX_SPEC_BYTES = 64 * 1024
MAX_REGEX_CHARS = 256 * 1024
MAX_DEPTH = 32
MAX_ENUM = 1024
MAX_REPEAT = 1000
MAX_REPEAT_PRODUCT = 10000
KINDS = ("regex", "json_schema", "choices")

# Keywords outlines-core ignores: accepting them would produce outputs that fail validation.
_UNSUPPORTED = ("multipleOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains",
                "propertyNames", "minProperties", "maxProperties", "patternProperties", "unevaluatedProperties",
                "unevaluatedItems", "minContains", "maxContains", "dependencies")
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F-\x9F]'  # one unescaped JSON string character (the class outlines uses)
_PLACEHOLDER = "RGXPH{}Z"
# Our own format regexes: ASCII digits (outlines' `\d` is Unicode in Rust) and only valid calendar days.
_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
        r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = r"[0-9]{4}-" + _DAY
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "email": r"[A-Za-z0-9](?:[A-Za-z0-9._+-]{0,30}[A-Za-z0-9])?@[A-Za-z0-9](?:[A-Za-z0-9-]{0,30}[A-Za-z0-9])?"
             r"(?:\.[A-Za-z]{2,10}){1,2}",
    "uri": r"https?://[A-Za-z0-9](?:[A-Za-z0-9-]{0,30}[A-Za-z0-9])?(?:\.[A-Za-z]{2,10}){1,2}"
           r"(?:/[A-Za-z0-9._~-]{1,30}){0,5}",
}


class GrammarValidationError(ValueError):
    """A constraint that is malformed (code "invalid_value") or too expensive (code "grammar_too_complex")."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


def _fail(msg: str, code: str = "invalid_value") -> None:
    raise GrammarValidationError(msg, code)


# ---------------------------------------------------------------- regex checks


def _strip_anchors(regex: str) -> str:
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$") and not regex.endswith("\\$"):
        regex = regex[:-1]
    return regex


def check_regex(regex: str, what: str = "regex") -> None:
    """Structural checks with Python's regex parser: syntax, no lookaround/backreference/anchors, bounds."""
    import re._constants as C  # noqa: N812
    import re._parser as P  # noqa: N812

    if len(regex) > MAX_REGEX_CHARS:
        _fail(f"{what} is too long ({len(regex)} chars > {MAX_REGEX_CHARS})", "grammar_too_complex")
    # Unicode property classes are Rust syntax Python lacks: check structure with a stand-in class.
    probe = re.sub(r"\\[pP](\{[^}]*\}|[A-Za-z])", "x", regex)
    try:
        tree = P.parse(probe)
    except re.error as e:
        _fail(f"invalid {what}: {e.msg} at position {e.pos}")
    except RecursionError:
        _fail(f"{what} is nested too deeply", "grammar_too_complex")

    def walk(items: Any, product: int) -> None:
        for op, av in items:
            if op in (C.ASSERT, C.ASSERT_NOT):
                _fail(f"invalid {what}: lookaround assertions are not supported")
            if op in (C.GROUPREF, C.GROUPREF_EXISTS):
                _fail(f"invalid {what}: backreferences are not supported")
            if op is C.AT:
                _fail(f"invalid {what}: anchors and word boundaries (^, $, \\b, \\A, \\Z) are not supported "
                      "inside the pattern (the whole output must match)")
            if op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
                lo, hi, sub = av
                bound = lo if hi is C.MAXREPEAT else hi
                if lo > MAX_REPEAT or (hi is not C.MAXREPEAT and hi > MAX_REPEAT):
                    _fail(f"{what} repetition bound {{{lo},{'' if hi is C.MAXREPEAT else hi}}} exceeds "
                          f"{MAX_REPEAT}", "grammar_too_complex")
                inner = product * max(bound, 1)
                if inner > MAX_REPEAT_PRODUCT:
                    _fail(f"{what} nested repetition bounds multiply to {inner} > {MAX_REPEAT_PRODUCT}",
                          "grammar_too_complex")
                walk(sub, inner)
            elif op is C.SUBPATTERN:
                walk(av[-1], product)
            elif op is C.BRANCH:
                for alt in av[1]:
                    walk(alt, product)
            elif op in (C.ATOMIC_GROUP,):
                walk(av, product)

    try:
        walk(tree, 1)
    except RecursionError:
        _fail(f"{what} is nested too deeply", "grammar_too_complex")


# ---------------------------------------------------------------- choices


def escape_literal(text: str) -> str:
    """Escape a literal for both Python's and Rust's regex syntax (only the metacharacters)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$#&~-])", r"\\\1", text)


def choices_regex(spec: str) -> str:
    try:
        items = json.loads(spec)
    except json.JSONDecodeError as e:
        _fail(f"choices is not valid JSON: {e}")
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        _fail("choices must be a JSON list of strings")
    if not items:
        _fail("choices is empty")
    if len(items) > MAX_ENUM:
        _fail(f"too many choices ({len(items)} > {MAX_ENUM})", "grammar_too_complex")
    if any(x == "" for x in items):
        _fail("choices contains an empty string")
    return "(?:" + "|".join(escape_literal(x) for x in items) + ")"


# ---------------------------------------------------------------- integer / number ranges


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


# ---------------------------------------------------------------- JSON schema


def _depth(x: Any, limit: int) -> int:
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


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        _fail(f"unsupported $ref {ref!r}: only local references (#/...) are allowed")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            _fail(f"$ref {ref!r} does not resolve")
    return node


class _Rewriter:
    """Checks a schema and swaps in placeholders for what we convert ourselves."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.subs: dict[str, str] = {}
        self.checked: set[str] = set()  # refs whose targets were fully checked (keeps DAGs linear)

    def visit(self, s: Any, path: str, refs: tuple[str, ...]) -> Any:
        if isinstance(s, bool) or not isinstance(s, dict):
            return s
        if "$ref" in s:
            ref = s["$ref"]
            if not isinstance(ref, str):
                _fail(f"$ref at {path} must be a string")
            if ref in refs:
                _fail(f"recursive $ref {ref!r} at {path}: recursive schemas are not supported",
                      "grammar_too_complex")
            if ref not in self.checked:
                self.visit(_resolve(self.root, ref), ref, (*refs, ref))
                self.checked.add(ref)
        for kw in _UNSUPPORTED:
            if kw in s:
                _fail(f"unsupported JSON schema keyword {kw!r} at {path}")
        if s.get("uniqueItems") is True:
            _fail(f"unsupported JSON schema keyword 'uniqueItems' at {path}")
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                _fail(f"enum at {path} must be a non-empty list")
            if len(s["enum"]) > MAX_ENUM:
                _fail(f"enum at {path} has {len(s['enum'])} entries > {MAX_ENUM}", "grammar_too_complex")
        for lo_kw, hi_kw in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum")):
            lo, hi = s.get(lo_kw), s.get(hi_kw)
            if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
                _fail(f"unsatisfiable schema at {path}: {lo_kw} {lo} > {hi_kw} {hi}")
        for kw in ("minLength", "maxLength", "minItems", "maxItems"):
            if isinstance(s.get(kw), int) and s[kw] > MAX_REPEAT:
                _fail(f"{kw} {s[kw]} at {path} exceeds {MAX_REPEAT}", "grammar_too_complex")
        out = {}
        for k, v in s.items():
            if k in ("properties", "$defs", "definitions", "dependentSchemas"):
                out[k] = {n: self.visit(x, f"{path}/{k}/{n}", refs) for n, x in v.items()} if isinstance(v, dict) else v
            elif k in ("items", "additionalProperties", "contains"):
                out[k] = ([self.visit(x, f"{path}/{k}/{i}", refs) for i, x in enumerate(v)]
                          if isinstance(v, list) else self.visit(v, f"{path}/{k}", refs))
            elif k in ("anyOf", "oneOf", "allOf", "prefixItems"):
                out[k] = [self.visit(x, f"{path}/{k}/{i}", refs) for i, x in enumerate(v)] if isinstance(v, list) else v
            else:
                out[k] = v
        return self._placeholder(out, path)

    def _placeholder(self, s: dict, path: str) -> dict:
        if any(k in s for k in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")):
            return s
        typ = s.get("type")
        ranged = any(k in s for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
        if isinstance(typ, list) and (ranged or "minLength" in s or "maxLength" in s):
            _fail(f"unsupported at {path}: ranges or lengths with a list of types (use anyOf)")
        if typ in ("integer", "number") and ranged:
            return self._sub(number_range_regex(s, typ == "integer"))
        if typ == "string" and s.get("format") in _FORMATS and not any(
                k in s for k in ("pattern", "minLength", "maxLength")):
            return self._sub(f'"{_FORMATS[s["format"]]}"')
        if typ == "string" and ("minLength" in s or "maxLength" in s):
            if "pattern" in s or "format" in s:
                _fail(f"unsupported at {path}: minLength/maxLength together with pattern/format")
            lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
            bound = f"{{{lo},}}" if hi is None else f"{{{lo},{int(hi)}}}"
            return self._sub(f'"{_STRING_CHAR}{bound}"')
        return s

    def _sub(self, regex: str) -> dict:
        name = _PLACEHOLDER.format(len(self.subs))
        self.subs[name] = regex
        return {"const": name}


def json_schema_regex(spec: str, whitespace: str | None) -> str:
    if len(spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        _fail(f"json_schema is larger than {MAX_SPEC_BYTES} bytes", "grammar_too_complex")
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        _fail(f"json_schema is not valid JSON: {e}")
    if _depth(schema, MAX_DEPTH) > MAX_DEPTH:
        _fail(f"json_schema is nested deeper than {MAX_DEPTH}", "grammar_too_complex")
    if not isinstance(schema, (dict, bool)):
        _fail("json_schema must be a JSON object (or boolean)")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        _fail(f"invalid JSON schema at {where}: {e.message}")
    if isinstance(schema, bool):
        schema = {} if schema else _fail("json_schema `false` admits nothing")
    rw = _Rewriter(copy.deepcopy(schema))
    rewritten = rw.visit(rw.root, "#", ())
    from outlines_core.json_schema import build_regex_from_schema

    try:
        regex = build_regex_from_schema(json.dumps(rewritten), "" if whitespace is None else whitespace)
    except (ValueError, TypeError) as e:
        _fail(f"unsupported JSON schema: {str(e).splitlines()[0]}")
    for name, sub in rw.subs.items():
        regex = regex.replace(f'"{name}"', f"(?:{sub})")
    return regex


def to_regex(kind: str, spec: str, whitespace: str | None = None) -> str:
    """The regex a (kind, spec) constraint compiles to; raises GrammarValidationError naming the problem."""
    if not isinstance(spec, str):
        _fail(f"{kind} must be a string")
    if kind not in KINDS:
        _fail(f"unknown constraint kind {kind!r} (expected one of {', '.join(KINDS)})")
    if len(spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        _fail(f"{kind} is larger than {MAX_SPEC_BYTES} bytes", "grammar_too_complex")
    if kind == "regex":
        if not spec:
            _fail("regex is empty")
        regex = _strip_anchors(spec)
    elif kind == "choices":
        regex = choices_regex(spec)
    else:
        regex = json_schema_regex(spec, whitespace)
    check_regex(regex, kind if kind == "regex" else f"{kind} (as regex)")
    return regex


def validate(kind: str, spec: str, whitespace: str | None = None) -> None:
    """Cheap check for the server process: raises GrammarValidationError (ValueError) naming the problem."""
    to_regex(kind, spec, whitespace)


validate_outlines = validate  # the outlines backend's check (every other backend has its own module's validate)


# ---------------------------------------------------------------- shared by the llguidance / xgrammar backends

MAX_SAFE_INTEGER = 2**53 - 1  # I-JSON (RFC 7493): integers beyond this do not survive a JSON round trip

# The validation keywords of JSON Schema drafts 04 to 2020-12 (anything else is an annotation or an unknown
# keyword, which validators ignore too): check_keywords refuses those a backend does not enforce.
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "items", "additionalItems", "prefixItems", "maxItems",
    "minItems", "uniqueItems", "contains", "maxContains", "minContains", "maxProperties", "minProperties",
    "required", "properties", "patternProperties", "additionalProperties", "propertyNames", "dependencies",
    "dependentRequired", "dependentSchemas", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "unevaluatedItems", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef",
})
ANNOTATIONS = frozenset({"$defs", "definitions"})  # containers of subschemas, checked when referenced
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
                  "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


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
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
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
    return _normalize_draft(schema, any(f"draft-0{n}" in draft for n in (3, 4, 6, 7)))


def _subschemas(s: dict) -> list[Any]:
    out: list[Any] = []
    for k in _SUBSCHEMA_MAPS:
        if isinstance(s.get(k), dict):
            out.extend(s[k].values())
    for k in _SUBSCHEMA_ONE:
        v = s.get(k)
        out.extend(v if isinstance(v, list) else [v])
    for k in _SUBSCHEMA_LISTS:
        if isinstance(s.get(k), list):
            out.extend(s[k])
    if isinstance(s.get("dependencies"), dict):
        out.extend(v for v in s["dependencies"].values() if isinstance(v, dict))
    return [x for x in out if isinstance(x, dict)]


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
    for sub in _subschemas(s):
        _normalize_draft(sub, ref_overrides)
    return s


# Longest valid value of a string format (RFC 5321 section 4.5.3.1: a 254-byte address path; RFC 1035: 253-byte
# host names; URIs past 2,000 characters are refused by common servers and browsers).
EMAIL_PARTS = "^[^@]{1,64}@[^@]{1,253}$"
FORMAT_MAX_LENGTH = {"email": 254, "idn-email": 254, "hostname": 253, "idn-hostname": 253, "uri": 2048,
                     "uri-reference": 2048, "iri": 2048, "iri-reference": 2048}


def bound_runaway_values(schema: dict | bool, enabled: bool = True, formats: bool = True,
                         closed_objects: bool = False) -> dict | bool:
    """Give every integer without a bound the I-JSON range [-(2^53-1), 2^53-1] (at most 16 digits), and every
    string format with a standard length limit that limit as maxLength, so a sampled value cannot run on for
    the whole token budget. Values these bounds cut off are ones no consumer accepts. closed_objects: an object
    listing `properties` without additionalProperties/patternProperties gets `additionalProperties: false`
    (not inside or beside an allOf, where branches share keys). In place."""
    if not enabled or not isinstance(schema, dict):
        return schema
    stack = [schema]
    in_all_of: set[int] = set()  # ids of subschemas that are allOf branches
    while stack:
        s = stack.pop()
        if isinstance(s.get("allOf"), list):
            in_all_of.update(id(x) for x in s["allOf"])
        if (closed_objects and isinstance(s.get("properties"), dict) and id(s) not in in_all_of and "allOf" not in s
                and not any(k in s for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))):
            s["additionalProperties"] = False
        t = s.get("type")
        if t == "integer" or (isinstance(t, list) and "integer" in t and "number" not in t):
            if "minimum" not in s and "exclusiveMinimum" not in s:
                s["minimum"] = -MAX_SAFE_INTEGER
            if "maximum" not in s and "exclusiveMaximum" not in s:
                s["maximum"] = MAX_SAFE_INTEGER
        limit = FORMAT_MAX_LENGTH.get(s.get("format")) if isinstance(s.get("format"), str) else None
        if formats and limit is not None and not isinstance(s.get("maxLength"), int):
            s["maxLength"] = limit
        if formats and s.get("format") in ("email", "idn-email") and "pattern" not in s:
            s["pattern"] = EMAIL_PARTS  # RFC 5321: a local part of at most 64 octets
        stack.extend(_subschemas(s))
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
        for k in _SUBSCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                stack.extend((x, f"{path}/{k}/{n}") for n, x in s[k].items() if isinstance(x, dict))
        for k in _SUBSCHEMA_ONE:
            if isinstance(s.get(k), dict):
                stack.append((s[k], f"{path}/{k}"))
            elif isinstance(s.get(k), list):
                stack.extend((x, f"{path}/{k}/{i}") for i, x in enumerate(s[k]) if isinstance(x, dict))
        for k in _SUBSCHEMA_LISTS:
            if isinstance(s.get(k), list):
                stack.extend((x, f"{path}/{k}/{i}") for i, x in enumerate(s[k]) if isinstance(x, dict))
