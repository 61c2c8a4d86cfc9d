"""Constrained decoding: regex / JSON-schema / choices grammars on outlines-core (DESIGN.md section 6).

Public API (see backend.py for the threading model, grammar.py for the per-step flow, schema.py for limits):
    GrammarBackend(vocab, eos_ids, cfg) / GrammarBackend.from_tokenizer(tok, cfg)
        .validate(kind, spec)            raises GrammarValidationError (ValueError, .code)
        .submit(kind, spec) -> GrammarFuture   (.done(), .result() -> Grammar | GrammarError | None, .cancel())
        .stats() -> dict, .close()
    Grammar: accept_token, is_terminated, fill_mask, write_bitmask, jump_forward, jump_forward_bytes, rollback,
             replace_tail, advance_text, copy
    apply_grammar_masks(logits, grammars), fill_masks(grammars, mask), plan_jump_forward(...) -> JumpPlan
Scheduler seam (runtime/scheduler/process.py): create_grammar_backend(cfg, tok); backend.get_future(SamplingParams) ->
    SchedulerFuture | None (result() -> Grammar or raises GrammarCompileError). Server: validate_params(sp).
Names load lazily so the compile worker (which needs only schema.py) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GrammarBackend": "backend", "GrammarError": "backend", "GrammarFuture": "backend",
    "GrammarCompileError": "backend", "SchedulerFuture": "backend", "create_grammar_backend": "backend",
    "params_constraint": "backend", "validate_params": "backend",
    "CompiledGrammar": "grammar", "Grammar": "grammar", "JumpPlan": "grammar", "apply_grammar_masks": "grammar",
    "fill_masks": "grammar", "plan_jump_forward": "grammar", "unpack_bitmask": "grammar",
    "GrammarValidationError": "schema", "to_regex": "schema", "validate": "schema",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime.constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(f"runtime.constrained.{_WHERE[name]}"), name)
