"""--kv-cache-dtype float16 under a float32 SmolLM2 (the pool holds float16, everything else stays float32).

The native CPU kernels and the torch backend read the same float16 values and compute in float32, so their greedy
continuations agree; against a float32 pool the logits move by the float16 rounding of K and V only: the bound
below (0.05 on logits up to ~36 in magnitude; measured max 0.013 on an AVX2 EPYC) is loose enough for any CPU's
summation order and tight enough to catch a pool read as the wrong type (that moves logits by whole units)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import make_config
from runtime.executor.greedy import OfflineBatch, greedy_generate
from runtime.executor.model_runner import create_model_runner

PROMPTS = [list(range(100, 100 + n)) for n in (5, 70, 150)] + [[7, 8, 9] * 20]


@pytest.fixture(scope="module")
def f16_runner(smollm_path):
    return create_model_runner(make_config(model_path=smollm_path, dtype="float32", kv_cache_dtype="float16",
                                           max_total_tokens=4096), progress=False)


def test_pool_is_float16_and_half_the_bytes(f16_runner, smollm_runner) -> None:
    assert f16_runner.pool.k_cache.dtype == torch.float16 and f16_runner.dtype == torch.float32
    assert smollm_runner.pool.k_cache.dtype == torch.float32
    a, b = f16_runner.pool.k_cache, smollm_runner.pool.k_cache
    assert a.element_size() * 2 == b.element_size()


def test_native_equals_torch_backend(f16_runner) -> None:
    from kernels import create_attn_backend

    saved = f16_runner.attn
    outs = {}
    try:
        for name in ("torch", "cpu"):
            f16_runner.attn = create_attn_backend(name, f16_runner.pool.k_cache, f16_runner.pool.v_cache,
                                                  saved.scale)
            outs[name] = greedy_generate(f16_runner, PROMPTS, 12)
    finally:
        f16_runner.attn = saved
    assert outs["cpu"] == outs["torch"]


def _logits(runner, steps: int = 8) -> torch.Tensor:
    """Prefill then `steps` forced decode steps (the same tokens for both pools): every step's logits."""
    batch = OfflineBatch(runner, PROMPTS)
    try:
        out = [batch.extend(PROMPTS)]
        for i in range(steps):
            out.append(batch.extend([[200 + i]] * len(PROMPTS), is_decode=True))
        return torch.stack(out)
    finally:
        batch.release()


def test_logits_close_to_a_float32_pool(f16_runner, smollm_runner) -> None:
    got, want = _logits(f16_runner), _logits(smollm_runner)
    diff = (got - want).abs().max().item()
    assert 0 < diff < 0.05, diff  # nonzero: the pool really rounds
