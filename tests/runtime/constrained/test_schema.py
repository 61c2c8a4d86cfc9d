"""Constraint validation and conversion (no workers, no vocabulary): errors name the problem, limits hold,
range regexes are exact."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.constrained.errors import GrammarValidationError
from runtime.constrained.ranges import int_range_regex
from runtime.constrained.schema import MAX_REPEAT, choices_regex, to_regex, validate


@pytest.mark.parametrize(("kind", "spec", "needle"), [
    ("regex", "foo**", "multiple repeat"),
    ("regex", "((", "missing ), unterminated subpattern"),
    ("regex", "(?=a)b", "lookaround"),
    ("regex", r"(a)\1", "backreference"),
    ("regex", r"a\bb", "anchors"),
    ("regex", "", "empty"),
    ("json_schema", "{bad", "not valid JSON"),
    ("json_schema", '{"properties": {"foo": "bar"}}', "invalid JSON schema at properties/foo"),
    ("json_schema", '{"type": "strnig"}', "invalid JSON schema"),
    ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}', "unsatisfiable"),
    ("json_schema", '{"enum": []}', "non-empty"),
    ("json_schema", '{"type": "integer", "multipleOf": 3}', "multipleOf"),
    ("json_schema", '{"$ref": "http://example.com/s.json"}', "only local"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "does not resolve"),
    ("json_schema", '[1, 2]', "must be a JSON object"),
    ("json_schema", '{"type": "string", "format": "hostname"}', "not supported"),
    ("json_schema", '{"type": "string", "pattern": "[a-z]+", "maxLength": 3}', "pattern/format"),
    ("choices", '["a", 1]', "list of strings"),
    ("choices", "[]", "empty"),
    ("ebnf", "root ::= 'a'", "unknown constraint kind"),
])
def test_invalid_specs_name_the_problem(kind: str, spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        validate(kind, spec)
    assert info.value.code == "invalid_value"


@pytest.mark.parametrize(("kind", "spec", "needle"), [
    ("regex", "(a|aa){1,10000}", "exceeds 1000"),
    ("regex", "[a-z]{1,100000}", "exceeds 1000"),
    ("regex", "(a{1,200}){1,200}", "multiply"),
    ("json_schema", '{"type": "string", "maxLength": 100000}', "maxLength 100000"),
    ("json_schema", '{"type": "array", "items": {"type": "integer"}, "maxItems": 50000}', "maxItems"),
    ("json_schema", '{"$ref": "#"}', "recursive $ref"),
    ("json_schema", json.dumps({"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                "$defs": {"node": {"type": "object",
                                                   "properties": {"next": {"$ref": "#/$defs/node"}}}}}),
     "recursive $ref"),
    ("json_schema", json.dumps({"enum": list(range(2000))}), "2000 entries"),
    ("json_schema", "[" * 40 + "]" * 40, "nested deeper"),
    ("json_schema", json.dumps({"description": "x" * 70000}), "larger than"),
    ("choices", json.dumps([str(i) for i in range(1500)]), "too many choices"),
])
def test_too_complex_specs_are_grammar_too_complex(kind: str, spec: str, needle: str) -> None:
    with pytest.raises(GrammarValidationError, match=re.escape(needle)) as info:
        validate(kind, spec)
    assert info.value.code == "grammar_too_complex"


def test_anchors_at_the_ends_are_dropped_and_unicode_classes_pass() -> None:
    assert to_regex("regex", "^[a-z]+$") == "[a-z]+"
    validate("regex", r"\p{Greek}{1,5}")
    validate("regex", f"[a-z]{{1,{MAX_REPEAT}}}")


def test_compact_json_by_default_and_whitespace_pattern_option() -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    compact = to_regex("json_schema", schema)
    assert re.fullmatch(compact, '{"a":true}') and not re.fullmatch(compact, '{ "a": true}')
    loose = to_regex("json_schema", schema, whitespace=r"[ ]?")
    assert re.fullmatch(loose, '{ "a": true}')


def test_choices_escape_metacharacters() -> None:
    items = ["a.b", "(x|y)", "c*+?", "[z]", "{1}", "^$", "back\\slash", "dash-&~#"]
    rx = choices_regex(json.dumps(items))
    for it in items:
        assert re.fullmatch(rx, it)
    assert not re.fullmatch(rx, "aXb")


@settings(max_examples=150, deadline=None)
@given(st.integers(-3000, 3000), st.integers(0, 3000), st.booleans(), st.booleans())
def test_int_range_regex_is_exact(lo: int, width: int, open_lo: bool, open_hi: bool) -> None:
    hi = lo + width
    a = None if open_lo else lo
    b = None if open_hi else hi
    rx = re.compile(int_range_regex(a, b))
    for n in range(lo - 60, hi + 60):
        inside = (a is None or n >= a) and (b is None or n <= b)
        assert bool(rx.fullmatch(str(n))) == inside, (a, b, n)
    assert not rx.fullmatch("-0") and not rx.fullmatch("007")


@settings(max_examples=60, deadline=None)
@given(st.integers(-50, 50), st.integers(1, 80), st.booleans())
def test_number_ranges_are_sound(lo: int, width: int, exclusive: bool) -> None:
    hi = lo + width
    schema = ({"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi} if exclusive
              else {"type": "number", "minimum": lo, "maximum": hi})
    rx = re.compile(to_regex("json_schema", json.dumps(schema)))
    texts = [str(n) for n in range(lo - 3, hi + 3)] + [f"{n}.5" for n in range(lo - 3, hi + 3)]
    for text in [*texts, "-0.25", "0.0", f"{lo}.0", f"{hi}.01"]:
        if rx.fullmatch(text):
            v = float(text)
            assert (lo < v < hi) if exclusive else (lo <= v <= hi), (schema, text)
    assert rx.fullmatch(str(lo + 1) if exclusive and width > 1 else str(lo + 0.5) if exclusive else str(lo))
