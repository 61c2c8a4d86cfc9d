"""The xgrammar backend: a pushdown automaton with a precomputed per-state token cache (mlc-ai/xgrammar).

Kinds: json_schema, regex, choices (a regex alternation), ebnf (xgrammar's own GBNF dialect, SGLang's `ebnf`),
structural_tag (SGLang's {"structures": [...], "triggers": [...]}).

xgrammar's JSON-schema converter silently ignores some keywords (an output would then not validate), so a schema
first passes `schema.check_keywords` with XGRAMMAR_KEYWORDS: anything else is refused naming the keyword. The set
was measured on JSONSchemaBench's MaskBench cases (tests/runtime/constrained/test_jsonschemabench.py): with it,
no invalid instance is accepted.

xgrammar 0.2.9 compiles a schema `pattern` with an optional group holding a repetition wrongly: for
`^P([0-9]+Y)?$` it lets "P1" end the string. The bounded form `(...){0,1}` compiles right, so every schema
`pattern` passes `optional_groups_bounded` first (`Grammar.from_regex`, the regex kind, has no such bug).

Vocabulary: `TokenizerInfo` over our raw token bytes (VocabType.RAW: bytes as they are), special tokens as empty
strings (never emitted), EOS ids as stop tokens. Compile runs on the backend's compile thread (xgrammar's
compiler releases the GIL); requests get a fresh `GrammarMatcher` over the shared `CompiledGrammar`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import xgrammar as xgr

from runtime.config import GrammarConfig
from runtime.constrained.errors import GrammarValidationError
from runtime.constrained.grammar import GrammarError, MatcherGrammar, VocabInfo, _bit
from runtime.constrained.json_caps import Caps
from runtime.constrained.json_rules import bound_runaway_values, check_keywords, parse_schema, subschemas
from runtime.constrained.schema import choices_regex

# Keywords xgrammar 0.2 enforces (annotations are always fine: see json_rules.ANNOTATIONS).
XGRAMMAR_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "$ref", "$defs", "definitions", "pattern", "format",
    "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})
# Combinations xgrammar 0.2.9 accepts but does not enforce (measured: each let a MaskBench invalid document
# through): refused by _refuse_combinations. oneOf and allOf are not in XGRAMMAR_KEYWORDS for the same reason
# (oneOf is read as anyOf; allOf is not intersected).
_NOT_BESIDE_ANYOF = ("properties", "additionalProperties", "required", "items", "enum", "const", "pattern",
                     "minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum")
# String formats xgrammar has a grammar for.
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


def build_tokenizer_info(tokens: Sequence[bytes | None], eos_ids: frozenset[int]) -> xgr.TokenizerInfo:
    """tokens[i] = the bytes of token i, None for special tokens (never allowed unless EOS)."""
    enc = [b"" if b is None else bytes(b) for b in tokens]
    return xgr.TokenizerInfo(enc, xgr.VocabType.RAW, vocab_size=len(enc), stop_token_ids=sorted(eos_ids))


def _json_type_ok(v: object, t: str) -> bool:
    if t == "integer":
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    kinds = {"string": str, "boolean": bool, "object": dict, "array": list}
    return v is None if t == "null" else isinstance(v, kinds.get(t, ()))


def _refuse_combinations(schema: dict | bool) -> None:
    """In place: enum/const values of the wrong `type` dropped (xgrammar enforces only the enum there); raises
    GrammarValidationError for combinations xgrammar would not enforce."""
    if not isinstance(schema, dict):
        return
    stack: list[dict] = [schema]
    while stack:
        s = stack.pop()
        t = s.get("type")
        types = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        if types is not None and ("enum" in s or "const" in s):
            values = s["enum"] if "enum" in s else [s["const"]]
            keep = [v for v in values if any(_json_type_ok(v, x) for x in types)]
            if not keep:
                raise GrammarValidationError(f"unsatisfiable JSON schema: no enum/const value has type {t!r}")
            s.pop("const", None)
            s["enum"] = keep
        if "format" in s and "pattern" in s:
            raise GrammarValidationError("unsupported JSON schema: 'pattern' together with 'format' (the xgrammar "
                                         "grammar backend enforces only the format)")
        if "anyOf" in s and any(k in s for k in _NOT_BESIDE_ANYOF):
            other = next(k for k in _NOT_BESIDE_ANYOF if k in s)
            raise GrammarValidationError(f"unsupported JSON schema: {other!r} beside 'anyOf' (the xgrammar grammar "
                                         "backend enforces only the anyOf branches)")
        if "$ref" in s and any(k in s for k in XGRAMMAR_KEYWORDS if k not in ("$ref", "$defs", "definitions")):
            raise GrammarValidationError("unsupported JSON schema: keywords beside '$ref' (the xgrammar grammar "
                                         "backend enforces only the reference)")
        stack.extend(subschemas(s))


def optional_groups_bounded(pattern: str) -> str:
    """`(...)?` -> `(...){0,1}` (same language; see the module docstring). Only a `?` right after the `)` that
    closes a group: not after an escaped `\\)` or a `)` inside a character class, and a lazy `?` after a
    quantifier (the second `?` of `(a)??`, `+?`, `*?`, `}?`) or the `?` of an opener like `(?:` is left as it is.
    A `]` first in a class (`[]...]`, `[^]...]`) is taken as a literal, as Python's `re` and PCRE read it."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])  # the escape and what it escapes
            i += 2
            continue
        out.append(c)
        i += 1
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a leading `]` is part of the class
                out.append("]")
                i += 1
        elif c == ")" and pattern.startswith("?", i):
            out.append("{0,1}")
            i += 1  # a lazy `?` after it stays, on the next turn, as a plain character
    return "".join(out)


def _bound_optional_groups(schema: dict | bool) -> dict | bool:
    """In place: every subschema's string `pattern` through optional_groups_bounded (a property named
    "pattern", or a "pattern" key in an enum/const value, is not a subschema's keyword and stays)."""
    if not isinstance(schema, dict):
        return schema
    stack: list[dict] = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s.get("pattern"), str):
            s["pattern"] = optional_groups_bounded(s["pattern"])
        stack.extend(subschemas(s))
    return schema


def _check_schema(spec: str, cfg: GrammarConfig) -> dict | bool:
    schema = parse_schema(spec)
    check_keywords(schema, XGRAMMAR_KEYWORDS, XGRAMMAR_FORMATS, "xgrammar", lengths_with_patterns=False)
    _refuse_combinations(schema)
    # formats=False, caps not beside patterns: xgrammar ignores a maxLength next to a pattern or format
    caps = Caps(cfg.json_max_string_length, cfg.json_max_array_items, beside_patterns=False, untyped=False,
                key_patterns=False)  # no patternProperties in xgrammar: free-form keys stay unbounded
    schema = bound_runaway_values(schema, formats=False, closed_objects=not cfg.json_allow_extra_properties,
                                  caps=caps)
    return _bound_optional_groups(schema)


def _json_kwargs(cfg: GrammarConfig) -> dict:
    if cfg.constrained_json_whitespace_pattern is None:
        return {"any_whitespace": False, "separators": (",", ":")}  # compact JSON (its default has spaces)
    return {"any_whitespace": True, "max_whitespace_cnt": 8}


def _grammar(kind: str, spec: str, cfg: GrammarConfig) -> xgr.Grammar:
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(json.dumps(_check_schema(spec, cfg)), strict_mode=False, **_json_kwargs(cfg))
        if kind == "regex":
            if not spec:
                raise GrammarValidationError("regex is empty")
            return xgr.Grammar.from_regex(spec)
        if kind == "choices":
            return xgr.Grammar.from_regex(choices_regex(spec))
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec)
        if kind == "structural_tag":
            return _structural_tag(spec, cfg)
    except GrammarValidationError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError naming the problem
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GrammarValidationError(f"{kind} is not supported by the xgrammar backend: {msg[:400]}") from None
    raise GrammarValidationError(f"unknown constraint kind {kind!r}")


def _structural_tag(spec: str, cfg: GrammarConfig) -> xgr.Grammar:
    try:
        st = json.loads(spec)
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(_check_schema(json.dumps(s["schema"]), cfg)),
                                       end=s["end"]) for s in st["structures"]]
        triggers = list(st["triggers"])
        if st.get("only_tags"):
            raise GrammarValidationError("structural_tag only_tags (tool_choice required/named in a tool-call "
                                         "format's syntax) needs --grammar-backend llguidance")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise GrammarValidationError(f"structural_tag needs 'structures' (begin, schema, end) and 'triggers': {e}") \
            from None
    return xgr.Grammar.from_structural_tag(items, triggers)


def validate(kind: str, spec: str, cfg: GrammarConfig) -> None:
    """Server-process check without a vocabulary: keyword support and grammar construction."""
    _grammar(kind, spec, cfg)


class XGrammarCompiled:
    def __init__(self, compiled: xgr.CompiledGrammar, eos_ids: frozenset[int], vocab_size: int) -> None:
        self.compiled = compiled
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size

    def new_state(self) -> XGrammarGrammar:
        return XGrammarGrammar(self)


def compile_grammar(compiler: xgr.GrammarCompiler, kind: str, spec: str, cfg: GrammarConfig,
                    eos_ids: frozenset[int], vocab_size: int) -> XGrammarCompiled:
    grammar = _grammar(kind, spec, cfg)
    try:
        compiled = compiler.compile_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - xgrammar's own errors name the problem
        raise GrammarValidationError(f"{kind} failed to compile with xgrammar: {str(e)[:400]}") from None
    return XGrammarCompiled(compiled, eos_ids, vocab_size)


class XGrammarGrammar(MatcherGrammar):
    def __init__(self, compiled: XGrammarCompiled) -> None:
        super().__init__(compiled.eos_ids, compiled.vocab_size)
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled.compiled, terminate_without_stop_token=False)

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiled)

    def _consume(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def _backtrack(self, n: int) -> None:
        self.matcher.rollback(n)

    def is_accepting(self) -> bool:
        return self.matcher.is_completed()

    def _only_eos_next(self) -> bool:
        """Complete, and the mask allows only stop tokens (one mask pass, only in complete states)."""
        if not self.matcher.is_completed():
            return False
        row = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self._write_row(row)
        for e in self.eos_ids:
            row[e >> 5] &= ~_bit(e)
        return not bool(row.any())

    def _forced_bytes(self) -> bytes:
        return self.matcher.find_jump_forward_string().encode("utf-8")

    def _write_row(self, row: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(row.view(1, -1), 0)

    @classmethod
    def _fill_backend_rows(cls, grammars: Sequence[MatcherGrammar], bitmask: torch.Tensor) -> None:
        if len(grammars) == 1:
            grammars[0]._write_row(bitmask[0])
            return
        _batch().batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)  # type: ignore[attr-defined]


_BATCH: xgr.BatchGrammarMatcher | None = None


def _batch() -> xgr.BatchGrammarMatcher:
    global _BATCH
    if _BATCH is None:
        _BATCH = xgr.BatchGrammarMatcher()
    return _BATCH


class XGrammarEngine:
    """Compiles on the backend's compile threads with one shared `GrammarCompiler` (thread-safe)."""

    name = "xgrammar"
    kinds = ("regex", "json_schema", "choices", "ebnf", "structural_tag")

    def __init__(self, vocab: VocabInfo, cfg: GrammarConfig) -> None:
        self.cfg = cfg
        self.eos_ids = vocab.eos_ids
        self.vocab_size = vocab.vocab_size
        info = build_tokenizer_info(vocab.tokens, vocab.eos_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def validate(self, kind: str, spec: str) -> None:
        validate(kind, spec, self.cfg)

    def new_slot(self) -> None:
        return None

    def close_slot(self, slot: None) -> None:
        pass

    def compile(self, slot: None, kind: str, spec: str) -> tuple[XGrammarCompiled | GrammarError, int, str]:
        try:
            return compile_grammar(self.compiler, kind, spec, self.cfg, self.eos_ids, self.vocab_size), 0, "compiled"
        except GrammarValidationError as e:
            return GrammarError(str(e), e.code), 0, "failed"
