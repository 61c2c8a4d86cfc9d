"""Gemma 3 against transformers on a tiny random checkpoint (sliding, full, sliding layers; window 5).

Full-sequence logits of ragged prompts longer than the window, then one request prefilled in chunks across the
window edge while another decodes in the same (mixed) steps, then decode-only steps: every step's logits
match transformers' logits of the whole sequence at the same positions (fp32, 1e-4).
The real checkpoint (Gemma 3 270M, Q4_K_M GGUF) is compared in tests/runtime/models/test_gemma3_gguf.py.
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import make_config
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.greedy import OfflineBatch
from runtime.executor.model_runner import create_model_runner
from tests.runtime.models.test_model import _ragged_logits
from tests.runtime.models.tiny import GEMMA3_WINDOW, tiny_checkpoint


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    import transformers as tf

    path = tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _runner(path: str, backend: str):
    return create_model_runner(make_config(model_path=path, dtype="float32", kv_cache_dtype="float32",
                                           max_total_tokens=512, max_running_requests=8,
                                           attention_backend=backend, disable_compile=True), progress=False)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tiny_gemma3_matches_transformers(gemma3, backend):
    path, hf = gemma3
    runner = _runner(path, backend)
    assert runner.arch.layer_windows == (GEMMA3_WINDOW, 0, GEMMA3_WINDOW)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 1, 23)]
    for ids, got in zip(prompts, _ragged_logits(runner, prompts), strict=True):
        torch.testing.assert_close(got, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tiny_gemma3_chunked_prefill_and_mixed_steps(gemma3, backend):
    """Request 0 decodes while request 1 is prefilled in chunks of 4 (mixed steps), then both decode."""
    path, hf = gemma3
    runner = _runner(path, backend)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (30, 30)]
    want = [_hf_logits(hf, s) for s in seqs]
    batch = OfflineBatch(runner, seqs)
    try:
        got0 = batch.extend([seqs[0][:9], seqs[1][:3]])  # both extend rows
        torch.testing.assert_close(got0, torch.stack([want[0][8], want[1][2]]), atol=1e-4, rtol=1e-4)
        pos = [9, 3]
        while pos[1] < 19:  # mixed: request 0 decodes one token, request 1 extends 4
            new = [seqs[0][pos[0] : pos[0] + 1], seqs[1][pos[1] : pos[1] + 4]]
            got = _step(batch, new, num_decode=1)
            pos = [pos[0] + 1, pos[1] + 4]
            torch.testing.assert_close(got, torch.stack([want[0][pos[0] - 1], want[1][pos[1] - 1]]),
                                       atol=1e-4, rtol=1e-4)
        for _ in range(6):  # decode-only steps past the window for both
            got = _step(batch, [seqs[0][pos[0] : pos[0] + 1], seqs[1][pos[1] : pos[1] + 1]], num_decode=2)
            pos = [pos[0] + 1, pos[1] + 1]
            torch.testing.assert_close(got, torch.stack([want[0][pos[0] - 1], want[1][pos[1] - 1]]),
                                       atol=1e-4, rtol=1e-4)
    finally:
        batch.release()


def _step(batch: OfflineBatch, new_ids: list[list[int]], num_decode: int) -> torch.Tensor:
    """One step with the first `num_decode` rows as decode rows; the last token's logits per request."""
    runner = batch.runner
    slots = batch._alloc(sum(len(x) for x in new_ids))
    start = 0
    for b, ids in enumerate(new_ids):
        runner.req_to_token.write(batch.rows[b], batch.lens[b], slots[start : start + len(ids)])
        start += len(ids)
    fb = ForwardBatch.build(new_ids, list(batch.lens), slots, batch.rows, num_decode=num_decode)
    batch.lens = [n + len(ids) for n, ids in zip(batch.lens, new_ids, strict=True)]
    return runner.forward(fb)
