"""The llguidance backend: an Earley parser over a lazily built lexer DFA (guidance-ai/llguidance).

Kinds: json_schema (llguidance's own JSON-schema compiler, strict: an unsupported keyword is an error naming it),
regex, choices (a regex alternation), ebnf (SGLang's GBNF text, converted to Lark by llguidance), structural_tag
(our own Lark grammar, runtime/constrained/structural_tag.py: a trigger cannot pass as free text).

Vocabulary: an `LLTokenizer` built from our own token bytes (GPT-2 byte-level tokens decoded to raw bytes by
runtime.tokenizer.Tokenizer.token_bytes), special tokens flagged as such (so only a grammar naming them may emit
them), EOS ids as llguidance's EOS. Its encode callback is our tokenizer's (plain text, no control tokens).

Compile = build the grammar text, construct an `LLMatcher` (drops the GIL) and compute one mask (the lexer's
first states) on the compile thread; requests get `deep_copy()`s of that matcher. Masks of a batch are filled
in one call on llguidance's thread pool (`LLExecutor`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import llguidance as llg
import torch

from runtime.config import GrammarConfig
from runtime.constrained.errors import GrammarValidationError
from runtime.constrained.grammar import GrammarError, MatcherGrammar, VocabInfo
from runtime.constrained.json_caps import Caps
from runtime.constrained.json_rules import bound_numbers, bound_runaway_values, parse_schema
from runtime.constrained.schema import choices_regex
from runtime.constrained.structural_tag import lark_grammar, parse_structural_tag

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared only in llguidance's stub

_EXECUTOR: llg.LLExecutor | None = None


def _executor() -> llg.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llg.LLExecutor()
    return _EXECUTOR


class _Wrapper:
    """What llguidance.TokenizerWrapper reads: per-id bytes, EOS/BOS, special ids, and an encode callback."""

    def __init__(self, tokens: Sequence[bytes], eos: int, bos: int | None, special: Sequence[int],
                 encode: Callable[[str], list[int]]) -> None:
        self.tokens = list(tokens)
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = list(special)
        self._encode = encode

    def __call__(self, s: str | bytes) -> list[int]:
        return self._encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)


def build_tokenizer(tokens: Sequence[bytes], special_ids: frozenset[int], eos_ids: frozenset[int],
                    bos_id: int | None, encode: Callable[[str], list[int]]) -> llg.LLTokenizer:
    """tokens[i] = the bytes of token i (a special token's text for special ids)."""
    wrapper = _Wrapper(tokens, min(eos_ids), bos_id, sorted(special_ids | eos_ids), encode)
    return llg.LLTokenizer(llg.TokenizerWrapper(wrapper), eos_token=sorted(eos_ids))


def _json_options(cfg: GrammarConfig) -> JsonCompileOptions:
    ws = cfg.constrained_json_whitespace_pattern
    if ws is None:
        return {"whitespace_flexible": False}  # compact JSON: no whitespace between tokens
    return {"whitespace_flexible": True, "whitespace_pattern": ws}


def grammar_text(kind: str, spec: str, cfg: GrammarConfig) -> str:
    """llguidance's grammar text for a (kind, spec) constraint; GrammarValidationError if malformed."""
    if kind == "json_schema":
        return _schema_text(parse_schema(spec), cfg)
    if kind == "regex":
        if not spec:
            raise GrammarValidationError("regex is empty")
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choices":
        return llg.LLMatcher.grammar_from_regex(choices_regex(spec))
    if kind == "ebnf":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return llg.LLMatcher.grammar_from_lark(any_to_lark(spec))
        except Exception as e:  # the converter's own parse errors (GbnfToLarkError, ValueError)
            raise GrammarValidationError(f"invalid ebnf grammar: {e}") from None
    if kind == "structural_tag":
        tag = parse_structural_tag(spec)
        schemas = [json.dumps(_tag_schema(st.schema, cfg), separators=(",", ":")) for st in tag.structures]
        return llg.LLMatcher.grammar_from_lark(lark_grammar(tag, schemas))
    raise GrammarValidationError(f"unknown constraint kind {kind!r}")


def _schema_grammar(schema: dict | bool, cfg: GrammarConfig) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_json_options(cfg))
    except ValueError as e:
        raise GrammarValidationError(f"invalid JSON schema: {e}") from None


def _levels(cfg: GrammarConfig) -> list[tuple[Caps | None, bool]]:
    """The runaway bounds to try, strictest first: (caps, bound numbers). llguidance cannot combine every bound
    with every schema (a maximum of 1e300 with the fraction bound; a length cap with an unanchored pattern whose
    emptiness it cannot decide), and then the next looser set is compiled, down to the schema's own bounds,
    rather than refusing a schema the user wrote correctly."""
    caps = Caps(cfg.json_max_string_length, cfg.json_max_array_items, cfg.json_max_object_properties)
    cap_levels: list[Caps | None] = [None]
    if caps.max_string or caps.max_items or caps.max_properties:
        cap_levels = [caps, dataclasses.replace(caps, beside_patterns=False), None]
    numbers = (True, False) if cfg.json_bound_numbers else (False,)
    return [(c, n) for n in numbers for c in cap_levels]


def _schema_text(schema: dict | bool, cfg: GrammarConfig) -> str:
    """llguidance's grammar text for a parsed schema under the strictest bounds it can compile."""
    bounded, text = _strictest(schema, cfg)
    return text if text is not None else _schema_grammar(bounded, cfg)


def _strictest(schema: dict | bool, cfg: GrammarConfig) -> tuple[dict | bool, str | None]:
    """`schema` under the strictest level of `_levels` llguidance compiles, with its grammar text (the last level
    if none does, text None: compiling it reports its error)."""
    levels = _levels(cfg)
    for caps, numbers in levels[:-1]:
        bounded = _bounded(copy.deepcopy(schema), cfg, caps, numbers)
        try:
            text = _schema_grammar(bounded, cfg)
        except GrammarValidationError:
            continue
        if not llg.LLMatcher.validate_grammar(text, None):
            return bounded, text
    caps, numbers = levels[-1]
    return _bounded(schema, cfg, caps, numbers), None


def _bounded(schema: dict | bool, cfg: GrammarConfig, caps: Caps | None, numbers: bool) -> dict | bool:
    """The runaway bounds (runtime/constrained/json_rules.py) the configuration asks for, in place."""
    schema = bound_runaway_values(schema, closed_objects=not cfg.json_allow_extra_properties, caps=caps)
    return bound_numbers(schema) if numbers else schema


def _tag_schema(schema: dict | bool, cfg: GrammarConfig) -> dict:
    """A structure's schema under the same rules as json_schema requests (runaway bounds, closed objects), with
    the JSON whitespace options carried inside it (`x-guidance`), as Lark's %json takes no other options."""
    if schema is False:
        raise GrammarValidationError("structural_tag: a structure's schema is `false` (nothing can match)")
    out = _strictest(parse_schema(json.dumps({} if schema is True else schema)), cfg)[0]
    assert isinstance(out, dict)
    return {**out, "x-guidance": _json_options(cfg)}


def _error(kind: str, msg: str) -> GrammarValidationError:
    low = msg.lower()
    code = "grammar_too_complex" if "too" in low and ("large" in low or "complex" in low) else "invalid_value"
    return GrammarValidationError(f"{kind} is not supported by the llguidance backend: {msg.strip()[:400]}", code)


def validate(kind: str, spec: str, cfg: GrammarConfig) -> None:
    """Server-process check without a vocabulary: grammar construction and llguidance's own validation."""
    text = grammar_text(kind, spec, cfg)
    err = llg.LLMatcher.validate_grammar(text, None)
    if err:
        raise _error(kind, err)


class LLGuidanceCompiled:
    """One compiled constraint: a matcher at the initial state (never advanced; requests deep-copy it)."""

    def __init__(self, matcher: llg.LLMatcher, eos_ids: frozenset[int], vocab_size: int) -> None:
        self.matcher = matcher
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size

    def new_state(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self)


def compile_grammar(tokenizer: llg.LLTokenizer, kind: str, spec: str, cfg: GrammarConfig,
                    eos_ids: frozenset[int]) -> LLGuidanceCompiled:
    text = grammar_text(kind, spec, cfg)
    m = llg.LLMatcher(tokenizer, text, log_level=0)
    if not m.is_error():
        m.compute_bitmask()  # builds the lexer's first states here, not on the scheduler's first mask
    if m.is_error():
        raise _error(kind, m.get_error())
    return LLGuidanceCompiled(m, eos_ids, tokenizer.vocab_size)


class LLGuidanceGrammar(MatcherGrammar):
    def __init__(self, compiled: LLGuidanceCompiled) -> None:
        super().__init__(compiled.eos_ids, compiled.vocab_size)
        self.compiled = compiled
        self.matcher = compiled.matcher.deep_copy()

    def copy(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self.compiled)

    def _consume(self, token_id: int) -> bool:
        # try_consume_tokens leaves the matcher usable on a rejected token (consume_token would poison it).
        return self.matcher.try_consume_tokens([token_id]) == 1

    def _backtrack(self, n: int) -> None:
        if not self.matcher.rollback(n):
            raise RuntimeError(f"llguidance rollback failed: {self.matcher.get_error()}")

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def _only_eos_next(self) -> bool:
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def _forced_bytes(self) -> bytes:
        return self.matcher.compute_ff_bytes()

    def _write_row(self, row: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    @classmethod
    def _fill_backend_rows(cls, grammars: Sequence[MatcherGrammar], bitmask: torch.Tensor) -> None:
        """All rows in one call on llguidance's thread pool."""
        pairs = [(g.matcher, k) for k, g in enumerate(grammars)]  # type: ignore[attr-defined]
        _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


class LLGuidanceEngine:
    """Compiles on the backend's compile threads (no subprocess: llguidance bounds its own work with parser and
    lexer fuel limits, and a grammar past them is an error naming the limit)."""

    name = "llguidance"
    kinds = ("regex", "json_schema", "choices", "ebnf", "structural_tag")

    def __init__(self, vocab: VocabInfo, cfg: GrammarConfig) -> None:
        self.cfg = cfg
        self.eos_ids = vocab.eos_ids
        tokens = [vocab.special.get(i, b"") if b is None else b for i, b in enumerate(vocab.tokens)]
        special = frozenset(i for i, b in enumerate(vocab.tokens) if b is None)
        encode = vocab.encode or (lambda s: [])
        self.tokenizer = build_tokenizer(tokens, special, vocab.eos_ids, vocab.bos_id, encode)

    def validate(self, kind: str, spec: str) -> None:
        validate(kind, spec, self.cfg)

    def new_slot(self) -> None:
        return None

    def close_slot(self, slot: None) -> None:
        pass

    def compile(self, slot: None, kind: str, spec: str) -> tuple[LLGuidanceCompiled | GrammarError, int, str]:
        try:
            return compile_grammar(self.tokenizer, kind, spec, self.cfg, self.eos_ids), 0, "compiled"
        except GrammarValidationError as e:
            return GrammarError(str(e), e.code), 0, "failed"
