"""Constrained decoding: regex / JSON-schema / choices / ebnf / structural-tag grammars over three backends
(llguidance, xgrammar, outlines).

Public API:
    seam.py: Grammar (what the scheduler side calls on a request's grammar), BaseGrammarBackend (get_future,
             stats, close), CompileFuture, GrammarCompileError
    pool.py: GrammarBackend(VocabInfo | vocab, eos_ids, cfg) / GrammarBackend.from_tokenizer(tok, cfg), the
             compile pool: .validate(kind, spec), .submit(kind, spec) -> GrammarFuture, .get_future(params),
             .compile_blocking(kind, spec), .stats(), .close(); create_grammar_backend(cfg, tok)
    grammar.py: MatcherGrammar (Grammar over a backend matcher), apply_grammar_masks(logits, grammars),
             fill_masks(grammars, mask), plan_jump_forward(...) -> JumpPlan
    validate.py: validate_params(sp, GrammarConfig), validate_spec(kind, spec, GrammarConfig),
             require_backend(name) (raises BackendUnavailable)
Names load lazily so the outlines compile worker (which needs only schema.py) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Grammar": "seam", "BaseGrammarBackend": "seam", "CompileFuture": "seam", "GrammarCompileError": "seam",
    "GrammarBackend": "pool", "GrammarFuture": "pool", "SchedulerFuture": "pool",
    "create_grammar_backend": "pool", "vocab_info": "pool",
    "BackendUnavailable": "validate", "params_constraint": "validate", "validate_params": "validate",
    "validate_spec": "validate", "require_backend": "validate", "BACKENDS": "validate",
    "MatcherGrammar": "grammar", "GrammarError": "grammar", "VocabInfo": "grammar", "JumpPlan": "grammar",
    "apply_grammar_masks": "grammar", "fill_masks": "grammar", "plan_jump_forward": "grammar",
    "unpack_bitmask": "grammar",
    "GrammarValidationError": "errors", "to_regex": "schema",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime.constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(f"runtime.constrained.{_WHERE[name]}"), name)
