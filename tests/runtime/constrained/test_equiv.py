"""Rewrites of a JSON schema into an equal one (runtime/constrained/json_equiv.py, json_oneof.py): oneOf with
provably exclusive branches -> anyOf, dependencies -> anyOf, `not` of required/type/properties -> positive
forms, format patterns, unknown formats dropped. Each rewritten schema must accept exactly the documents the
original accepts (jsonschema over a grid of documents, and over every MaskBench document); what cannot be
proved or rewritten stays as it was, and the backend refuses it naming the keyword."""

from __future__ import annotations

import copy
import gzip
import itertools
import json
import os
import re

import jsonschema
import pytest

from runtime.config import GrammarConfig
from runtime.constrained import Grammar, GrammarBackend, GrammarError
from runtime.constrained.json_equiv import FORMAT_PATTERNS, equivalent_forms, negate
from runtime.constrained.json_rules import parse_schema

S, INT, N = {"type": "string"}, {"type": "integer"}, {"type": "null"}
KIND = {"type": "object", "required": ["kind"]}
EQUAL = [
    # oneOf: types apart, through $ref
    {"$defs": {"when": {"type": "string", "description": "a date"}}, "oneOf": [{"$ref": "#/$defs/when"}, N]},
    {"oneOf": [S, INT, {"type": "array", "items": INT}]},
    # values apart (const/enum), on a discriminating required key, through allOf
    {"oneOf": [{**KIND, "properties": {"kind": {"const": "a"}, "v": INT}},
               {**KIND, "properties": {"kind": {"enum": ["b", "c"]}, "w": S}},
               {"allOf": [KIND, {"properties": {"kind": {"const": "d"}}}]}]},
    # a key one requires and the other forbids (closed), typeless branches: non-objects match both -> none
    {"oneOf": [{"properties": {"a": S, "b": S}, "required": ["a"]},
               {"properties": {"b": INT, "c": INT}, "additionalProperties": False}]},
    # one branch an anyOf whose every branch requires a key the other keeps to false
    {"$defs": {"repo": {"type": "object", "anyOf": [
        {"required": ["kind"], "properties": {"kind": {"const": "git"}}},
        {"required": ["kind", "c"], "properties": {"kind": {"enum": ["svn", "hg"]}}}]}},
     "oneOf": [{"$ref": "#/$defs/repo"}, {"type": "object", "additionalProperties": {"const": False}}]},
    # a sibling type: only objects need a proof
    {"type": "object", "oneOf": [{"required": ["a"], "properties": {"a": {"const": 1}}},
                                 {"required": ["a"], "properties": {"a": {"const": 2}}}]},
    # two branches take every string: oneOf takes no string, the third branch keeps integers only
    {"oneOf": [S, {"type": ["string", "null"]}, {"type": ["integer", "string"], "minimum": 0}]},
    # dependencies: keys and schemas, draft-04 and 2019-09 spellings
    {"$schema": "http://json-schema.org/draft-07/schema#",
     "dependencies": {"a": ["b"], "c": {"required": ["b"], "properties": {"b": INT}}}},
    {"type": "object", "dependentRequired": {"a": ["b", "c"]}, "dependentSchemas": {"b": {"maxProperties": 2}}},
    # not
    {"not": {"required": ["a", "b"]}},
    {"properties": {"a": INT}, "not": {"allOf": [{"required": ["a"]}, {"required": ["c"]}]}},
    {"not": {"type": ["string", "number"]}},
    {"not": {"anyOf": [S, {"required": ["a"]}]}},
    {"not": {"properties": {"a": {"not": INT}}}},
    {"not": {"not": {"type": "object", "required": ["b"]}}},
    {"items": {"not": {}}},
]
STAYS = [  # not provably equal to a form the backends enforce: left for the backend to refuse
    {"oneOf": [{"type": "string", "maxLength": 30}, S]},  # "ab" matches both; other strings one
    {"oneOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]},  # {"a":1,"b":2} matches both
    {"oneOf": [{"$ref": "other.json#/x"}, N]},  # a reference to another document: not known
    {"not": {"enum": ["a", "b"]}},
    {"not": {"type": "integer"}},  # "a number with a fraction" has no positive keyword
    {"not": {"type": "object", "additionalProperties": False}},  # additionalProperties reads its siblings
]
SCALARS = [None, True, False, 0, 1, -3, 1.5, "", "a", "ab", "x" * 40]
OBJECTS = [dict(zip(keys, vals, strict=True)) for n in range(4) for keys in itertools.combinations("abc", n)
           for vals in itertools.product([1, "x", None, False], repeat=n)]
DOCS = [*SCALARS, [], [1], ["a", "b"], [1, "a"], [{"a": 1}], *OBJECTS,
        *({"kind": k, **extra} for k in ("a", "b", "c", "d", "e", "git", "svn", 1)
          for extra in ({}, {"v": 1}, {"w": "s"}, {"c": 1}, {"kind2": False})),
        {"x": False}, {"x": False, "y": False}, {"kind": False}]


def rewritten(schema: dict) -> dict:
    out = parse_schema(json.dumps(schema))
    assert isinstance(out, dict)
    return out


@pytest.mark.parametrize("schema", EQUAL, ids=range(len(EQUAL)))
def test_rewrite_accepts_exactly_what_the_original_accepts(schema: dict) -> None:
    new = rewritten(copy.deepcopy(schema))
    text = json.dumps(new)
    assert not any(f'"{k}"' in text for k in ("oneOf", "not", "dependencies", "dependentRequired",
                                             "dependentSchemas")), text
    original = jsonschema.validators.validator_for(schema)(schema)  # the draft the schema names
    rewrite = jsonschema.Draft202012Validator(new)
    accepted = 0
    for doc in DOCS:
        assert original.is_valid(doc) == rewrite.is_valid(doc), (doc, new)
        accepted += original.is_valid(doc)
    assert 0 < accepted < len(DOCS)  # the grid tells the schema's documents apart


@pytest.mark.parametrize("schema", STAYS, ids=range(len(STAYS)))
def test_what_cannot_be_proved_stays(schema: dict) -> None:
    assert rewritten(copy.deepcopy(schema)) == schema


def test_negate_is_exact_on_its_forms() -> None:
    assert negate(True) is False and negate({}) is False and negate({"description": "x"}) is False
    assert negate(False) is True and negate({"required": []}) is False
    assert negate({"required": ["a"]}) == {"type": "object", "anyOf": [{"properties": {"a": False}}]}
    assert negate({"type": "integer"}) is None and negate({"enum": [1]}) is None


def test_maskbench_rewrites_agree_with_the_original_on_every_document() -> None:
    """All 475 schemas, every valid and invalid MaskBench document: the rewritten schema (drafts normalized
    first in both) decides each document as the original does."""
    from runtime.constrained.json_rules import _normalize_draft

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "jsonschemabench",
                        "maskbench_subset.json.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        entries = json.load(f)
    changed = checked = 0
    for e in entries:
        s = e["schema"]
        if not isinstance(s, dict):
            continue
        old = any(f"draft-0{n}" in str(s.get("$schema", "")) for n in (3, 4, 6, 7))
        base = _normalize_draft(copy.deepcopy(s), old)
        new = equivalent_forms(copy.deepcopy(base))
        if new == base:
            continue
        changed += 1
        vb = jsonschema.validators.validator_for(base)(base)
        vn = jsonschema.validators.validator_for(new)(new)
        for t in e["tests"]:
            checked += 1
            assert vb.is_valid(t["data"]) == vn.is_valid(t["data"]), (e["id"], t["data"])
    assert changed >= 80 and checked >= 250  # measured 87 schemas, 254 documents


FORMAT_CASES = {
    "json-pointer": (["", "/", "/a/b", "/a~1b/~0", "/ 0/%"], ["a", "/~2", "/~", "x/"]),
    "relative-json-pointer": (["0", "1#", "12/a~1", "0/"], ["", "01", "-1", "#", "/a", "1#/a"]),
    "uri-reference": (
        ["http://example.com/a?b=c#d", "urn:isbn:0451450523", "mailto:a@b.org", "//host:8080/p", "../a/b",
         "a/b:c", "?q", "#frag", "", "/abs/path", "file:///tmp/x", "http://u:p@h/%20x", "s:"],
        ["http://exa mple.com", "%zz", "//host:port", ":a", "a:b:c d", "http://h/a#b#c", "1a:b", "a\\b",
         "http://[::1", "<x>"]),
}


@pytest.mark.parametrize("name", sorted(FORMAT_CASES))
def test_format_patterns_follow_their_rfc(name: str) -> None:
    good, bad = FORMAT_CASES[name]
    pattern = re.compile(FORMAT_PATTERNS[name])
    assert all(pattern.search(x) for x in good), [x for x in good if not pattern.search(x)]
    assert not any(pattern.search(x) for x in bad), [x for x in bad if pattern.search(x)]


def test_formats_no_draft_defines_are_annotations() -> None:
    s = rewritten({"type": "object", "properties": {"p": {"type": "string", "format": "path"},
                                                    "i": {"type": "integer", "format": "int32"},
                                                    "u": {"type": "string", "format": "iri"}}})["properties"]
    assert "format" not in s["p"] and "format" not in s["i"] and s["u"]["format"] == "iri"


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


def test_llguidance_enforces_the_rewritten_forms(tok) -> None:  # noqa: ANN001
    from tests.runtime.constrained.cases import accepts

    cases = [
        (EQUAL[0], ['"2024-01-01"', "null"], ["1", "{}"]),
        (EQUAL[2], ['{"kind":"a","v":1}', '{"kind":"c","w":"s"}', '{"kind":"d"}'], ['{"kind":"e"}', '"a"']),
        (EQUAL[3], ['{"a":"x","b":"y"}', '{"b":1,"c":2}'], ['"x"', "1", '{"a":"x","b":1}']),
        (EQUAL[7], ['{"a":1,"b":2}', '{"b":1}', '{"b":2,"c":1}'], ['{"a":1}', '{"c":1}', '{"c":1,"b":"x"}']),
        (EQUAL[10], ['{"a":1}', '{"c":1}'], ['{"a":1,"c":2}']),
        ({"type": "object", "properties": {"p": {"type": "string", "format": "json-pointer"}}, "required": ["p"]},
         ['{"p":"/a~1b"}'], ['{"p":"a"}', '{"p":"/~2"}']),
    ]
    cfg = GrammarConfig(json_allow_extra_properties=True)
    with GrammarBackend.from_tokenizer(tok, cfg, num_workers=1) as be:
        for schema, good, bad in cases:
            g = be.compile_blocking("json_schema", json.dumps(schema))
            assert isinstance(g, Grammar), (schema, g)
            for doc in good:
                jsonschema.validate(json.loads(doc), schema)
                assert accepts(g.copy(), tok, doc), (schema, doc)
            for doc in bad:
                assert not accepts(g.copy(), tok, doc), (schema, doc)
        # a oneOf that is not exclusive and a format no pattern covers: 400s naming them
        err = be.compile_blocking("json_schema", json.dumps(STAYS[0]))
        assert isinstance(err, GrammarError) and "oneOf" in err.message
        err = be.compile_blocking("json_schema", json.dumps({"type": "string", "format": "iri"}))
        assert isinstance(err, GrammarError) and "iri" in err.message
