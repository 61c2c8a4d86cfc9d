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

Range regexes live in runtime/constrained/ranges.py; the JSON-schema rules the llguidance and xgrammar backends
share (draft parsing, runaway bounds, keyword checks) in runtime/constrained/json_rules.py.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from runtime.constrained.errors import fail as _fail
from runtime.constrained.json_rules import nesting_depth as _depth
from runtime.constrained.ranges import number_range_regex

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
        regex: str = build_regex_from_schema(json.dumps(rewritten), "" if whitespace is None else whitespace)
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
