"""Speculative decoding: proposers (what to guess) and the verification rule (what to keep).

The scheduler glue (drafts attached to decode rows, verify rows processed after the forward, KV of rejected
drafts freed) lives in runtime/scheduler/speculative.py; this package holds the model-free parts.
"""

from __future__ import annotations

from runtime.speculative.ngram import propose_from_source, propose_ngram
from runtime.speculative.verify import (
    accept_greedy,
    accept_sampled,
    draft_uniform,
    inverse_cdf,
    spec_uniforms,
)

__all__ = ["accept_greedy", "accept_sampled", "draft_uniform", "inverse_cdf", "propose_from_source", "propose_ngram", "spec_uniforms"]
