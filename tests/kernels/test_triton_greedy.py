"""SmolLM2 greedy decoding through the engine's model runner: the Triton attention backend gives the same
float32 tokens as the torch reference backend, for a batch of two prompts of different lengths prefilled in two
chunks and then decoded.

Runs everywhere: on a GPU the compiled kernels, on a CPU-only machine the same kernels under TRITON_INTERPRET=1
(set by tests/kernels/conftest.py), with fewer tokens there because the interpreter runs one program at a time
(~0.2 s per layer call): 2 tokens, the second from a batched decode step after the two chunked prefills. Tokens
must be identical until the first divergence, which may only fall on a float32 near-tie (top1 - top2 logit <
1e-3); on the prompts below no divergence is expected at all.
"""

from __future__ import annotations

import pytest

from tests.kernels.engine_greedy import assert_same_until_near_tie, engine_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def test_smollm2_engine_greedy_fp32_triton_equals_torch(device: str) -> None:
    from runtime.models.registry import default_model_path
    from runtime.tokenizer.load import load_tokenizer

    try:
        tok = load_tokenizer(default_model_path())
    except (FileNotFoundError, RuntimeError) as e:
        pytest.skip(f"default model not installed: {e}")
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])
    max_new = 24 if device == "cuda" else 2
    want, margins = engine_greedy(device, "torch", "float32", prompts, max_new)
    got, _ = engine_greedy(device, "triton", "float32", prompts, max_new)
    assert "Paris" in tok.decode(want[0]), tok.decode(want[0])
    assert_same_until_near_tie(tok, want, got, margins, near_tie=1e-3, max_new=max_new)
