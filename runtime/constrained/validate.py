"""Request validation for constraints, and which backend packages can load.

Server process: `validate_params(sp, GrammarConfig)` / `validate_spec(kind, spec, cfg)` check a request's
constraint with the configured backend's rules (a GrammarValidationError names the problem: the server answers
400). Start-up: `require_backend(name)` raises BackendUnavailable (one line naming the package and its install
command) when the configured engine cannot be imported.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from runtime.config import GrammarConfig
from runtime.constrained.errors import GrammarValidationError
from runtime.sampling.params import SamplingParams

BACKENDS = ("llguidance", "xgrammar", "outlines")
KINDS = ("regex", "json_schema", "choices", "ebnf", "structural_tag")
# backend -> (module, the PyPI package it needs)
_MODULES = {"llguidance": ("runtime.constrained.llguidance_backend", "llguidance"),
            "xgrammar": ("runtime.constrained.xgrammar_backend", "xgrammar"),
            "outlines": ("runtime.constrained.outlines_backend", "outlines-core")}


class BackendUnavailable(RuntimeError):
    """The configured grammar backend's package cannot be imported."""


def require_backend(name: str) -> Any:
    """The backend's module; BackendUnavailable naming the package and the install command otherwise."""
    if name not in _MODULES:
        raise BackendUnavailable(f"unknown grammar backend {name!r} (choose one of {', '.join(BACKENDS)} or none)")
    module, package = _MODULES[name]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailable(f"--grammar-backend {name} needs the {package!r} package, which failed to import "
                                 f"({e}); install it with: pip install {package}") from None


def params_constraint(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, spec) of a SamplingParams' constraint, or None."""
    if params.regex is not None:
        return "regex", params.regex
    if params.json_schema is not None:
        return "json_schema", params.json_schema
    if params.choices is not None:
        return "choices", json.dumps(list(params.choices))
    if params.ebnf is not None:
        return "ebnf", params.ebnf
    if params.structural_tag is not None:
        return "structural_tag", params.structural_tag
    return None


def validate_spec(kind: str, spec: str, cfg: GrammarConfig | None = None) -> None:
    """Server-side check of one constraint with the configured backend's rules (GrammarValidationError names
    the problem: an unsupported keyword, a size limit, a syntax error)."""
    cfg = cfg or GrammarConfig()
    if cfg.grammar_backend == "none":
        raise GrammarValidationError("constrained decoding is disabled (--grammar-backend none)")
    if kind not in KINDS:
        raise GrammarValidationError(f"unknown constraint kind {kind!r} (expected one of {', '.join(KINDS)})")
    mod = require_backend(cfg.grammar_backend)
    if cfg.grammar_backend == "outlines":
        mod.validate(kind, spec, cfg.constrained_json_whitespace_pattern)
    else:
        mod.validate(kind, spec, cfg)


def validate_params(params: SamplingParams, cfg: GrammarConfig | str | None = None) -> None:
    """Server-side check of a request's constraint (400 on GrammarValidationError, a ValueError). `cfg` may be
    the whitespace pattern alone (older callers): then the default backend's rules apply."""
    kc = params_constraint(params)
    if kc is None:
        return
    if not isinstance(cfg, GrammarConfig):
        cfg = GrammarConfig(constrained_json_whitespace_pattern=cfg)
    validate_spec(kc[0], kc[1], cfg)
