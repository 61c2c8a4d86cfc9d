"""Grammar test cases and samplers shared by the constrained tests.

`sample` is random logits (plus a fixed bias toward tokens that close strings/objects, so random walks end)
masked by the grammar: a stand-in for the model that explores far more of each grammar than a model would.
"""

from __future__ import annotations

import re

import regex as uregex
import torch

from runtime.constrained import Grammar, apply_grammar_masks


def sample(g: Grammar, tok, bias: torch.Tensor, seed: int, max_steps: int = 400) -> str:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        if g.is_terminated():
            return tok.decode(out)
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 2 + bias
        apply_grammar_masks(logits, [g])
        tid = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        g.accept_token(tid)
        if tid in tok.eos_token_ids:
            return tok.decode(out)
        out.append(tid)
    raise AssertionError(f"not terminated after {max_steps} steps: {tok.decode(out)!r}")


OBJ = {"type": "object"}


SCHEMAS = [
    {"type": "integer"},
    {"type": "boolean"},
    {"type": "string", "maxLength": 12},
    {"type": "number", "minimum": -5.5, "maximum": 120},
    {"type": "integer", "minimum": 18, "maximum": 99},
    {"type": "integer", "exclusiveMinimum": -100, "exclusiveMaximum": 0},
    {"enum": ["red", "green", "blue", 7, None]},
    {"const": "fixed-value"},
    {**OBJ, "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 150}},
     "required": ["name", "age"]},
    {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"]},
    {**OBJ, "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
    {**OBJ, "properties": {"user": {**OBJ, "properties": {"id": {"type": "integer", "minimum": 1},
                                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                                   "maxItems": 3}},
                                   "required": ["id", "tags"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
    {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
    {"type": ["boolean", "null"]},
    {**OBJ, "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]},
    {**OBJ, "properties": {"when": {"type": "string", "format": "date-time"}}, "required": ["when"]},
    {**OBJ, "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {**OBJ, "properties": {"mail": {"type": "string", "format": "email"}}, "required": ["mail"]},
    {**OBJ, "properties": {"site": {"type": "string", "format": "uri"}}, "required": ["site"]},
    {**OBJ, "properties": {"t": {"type": "string", "format": "time"}}, "required": ["t"]},
    {**OBJ, "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"}}, "required": ["zip"]},
    {**OBJ, "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}}, "required": ["code"]},
    {"$defs": {"pt": {**OBJ, "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                            "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                      "required": ["x", "y"]}},
     **OBJ, "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    {"definitions": {"color": {"enum": ["r", "g"]}}, "type": "array", "items": {"$ref": "#/definitions/color"},
     "maxItems": 4},
    {**OBJ, "properties": {"status": {"enum": ["ok", "error"]}, "detail": {"type": "string", "maxLength": 8},
                           "retry": {"type": "boolean"}}, "required": ["status"]},
    {**OBJ, "properties": {"matrix": {"type": "array", "maxItems": 2,
                                      "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}, "maxItems": 2}}},
     "required": ["matrix"]},
    {**OBJ, "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 12},
                           "note": {"type": "string", "minLength": 1, "maxLength": 6}},
     "required": ["price", "qty", "note"]},
]


REGEXES = [
    (r"\(\d{3}\) \d{3}-\d{4}", re), (r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}", re),
    (r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", re), (r"(0[1-9]|[12][0-9]|3[01])/(0[1-9]|1[0-2])/\d{4}", re),
    (r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])", re),
    (r"[a-z0-9._]{1,16}@[a-z0-9]{1,12}\.(com|org|net)", re), (r"[A-Z][a-z]{2,10}( [A-Z][a-z]{2,10}){0,2}", re),
    (r"(yes|no|maybe)", re), (r"#[0-9a-fA-F]{6}", re), (r"[α-ω]{1,6}", re), (r"[À-ÿ]{2,5}", re),
    (r"\p{Greek}{1,4}", uregex), (r"[日本語中文]{1,5}", re), (r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?", re),
    (r"v[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}", re), (r"([01][0-9]|2[0-3]):[0-5][0-9]", re),
    (r"[A-Z]{2}[0-9]{2} ?[A-Z0-9]{4}", re), (r"https?://[a-z]{1,10}\.(io|dev)(/[a-z]{1,8}){0,2}", re),
    (r"(foo|bar|baz)-[0-9]+", re), (r"\"[^\"\n]{0,10}\"", re),
]


LONG_KEYS = {"type": "object", "properties": {
    "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 999},
    "customer_preferred_contact_method": {"enum": ["email", "phone"]},
    "customer_account_is_active": {"type": "boolean"}},
    "required": ["customer_identification_number", "customer_preferred_contact_method",
                 "customer_account_is_active"]}


def accepts(g: Grammar, tok, text: str) -> bool:  # noqa: ANN001
    state = g.copy()
    ids = tok.encode(text, add_special_tokens=False, allow_special=False)
    if not state.can_accept(ids):
        return False
    state.accept_tokens(ids)
    return state.is_accepting()
