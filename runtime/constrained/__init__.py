"""Constrained decoding: regex / JSON-schema / choices / ebnf / structural-tag grammars over three backends
(llguidance, xgrammar, outlines; DESIGN.md section 6).

Public API (backend.py: threads, cache, the scheduler seam; grammar.py: the one Grammar class the scheduler uses):
    GrammarBackend(VocabInfo | vocab, eos_ids, cfg) / GrammarBackend.from_tokenizer(tok, cfg)
        .validate(kind, spec)            raises GrammarValidationError (ValueError, .code)
        .submit(kind, spec) -> GrammarFuture   (.done(), .result() -> Grammar | GrammarError | None, .cancel())
        .get_future(SamplingParams) -> SchedulerFuture | None, .stats() -> dict, .close()
    Grammar: accept_token, is_terminated, is_accepting, write_bitmask, fill_mask, jump_forward, rollback,
             replace_tail, advance_text, copy
    apply_grammar_masks(logits, grammars), fill_masks(grammars, mask), plan_jump_forward(...) -> JumpPlan
Start-up: create_grammar_backend(cfg, tok) (raises BackendUnavailable), require_backend(name).
Server: validate_params(sp, GrammarConfig), validate_spec(kind, spec, GrammarConfig).
Names load lazily so the outlines compile worker (which needs only schema.py) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GrammarBackend": "backend", "GrammarFuture": "backend", "BackendUnavailable": "backend",
    "GrammarCompileError": "backend", "SchedulerFuture": "backend", "create_grammar_backend": "backend",
    "params_constraint": "backend", "validate_params": "backend", "validate_spec": "backend",
    "require_backend": "backend", "vocab_info": "backend", "BACKENDS": "backend",
    "Grammar": "grammar", "GrammarError": "grammar", "VocabInfo": "grammar", "JumpPlan": "grammar",
    "apply_grammar_masks": "grammar", "fill_masks": "grammar", "plan_jump_forward": "grammar",
    "unpack_bitmask": "grammar",
    "GrammarValidationError": "errors", "to_regex": "schema",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime.constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(f"runtime.constrained.{_WHERE[name]}"), name)
