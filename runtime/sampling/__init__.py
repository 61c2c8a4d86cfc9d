"""Batched sampling for the scheduler: SamplingInfo (per-step tensors) and sample() (logits -> token ids)."""

from __future__ import annotations

from runtime.sampling.info import SamplingInfo, mix_seed
from runtime.sampling.sampler import (
    SampleOutput,
    compute_logprobs,
    greedy_ids,
    process_logits,
    sample,
    sample_processed,
    target_probs,
    top_logprobs,
)

__all__ = [
    "SampleOutput",
    "SamplingInfo",
    "compute_logprobs",
    "greedy_ids",
    "mix_seed",
    "process_logits",
    "sample",
    "sample_processed",
    "target_probs",
    "top_logprobs",
]
