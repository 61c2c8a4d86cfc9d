"""The real Gemma 3 270M (Q4_K_M GGUF) against transformers' own loading of the same file, float32.

Eight prompts, three of them longer than the 512-token window (about 700, 1,000 and 1,500 tokens), so every
sliding-window layer drops keys: last-position logits within 1e-4 of the largest logit, and 64 greedy tokens
equal, our batched prefill and decode against transformers' generate per prompt.
Runs under `make test-gemma` (which assembles the file; ~3 minutes on 2 cores), not in the default suite:
transformers alone takes about a minute to load the model.
"""

from __future__ import annotations

import glob
import os
import pathlib
import re

import pytest
import torch

from runtime.config import make_config
from runtime.executor.greedy import greedy_generate
from runtime.executor.model_runner import create_model_runner
from tests.runtime.models.test_model import _ragged_logits

pytestmark = pytest.mark.skipif(os.environ.get("RADIXGEN_TEST_GEMMA") != "1",
                                reason="the real Gemma 3 comparison runs under `make test-gemma`")

SHORT = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a small village by the sea,",
]
LONG_TOKENS = (700, 1000, 1500)


def _long_text() -> str:
    """The repository's own docs: natural English and code, deterministic, longer than 1,500 tokens."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    parts = [pathlib.Path(f).read_text() for f in sorted(glob.glob(os.path.join(root, "docs", "*.md")))]
    return "\n\n".join(parts)


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.models.registry import gemma3_model_path
    from runtime.tokenizer.load import load_tokenizer

    path = gemma3_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    runner = create_model_runner(make_config(model_path=path, dtype="float32", kv_cache_dtype="float32",
                                             quantization="none", max_total_tokens=8192, disable_compile=True),
                                 progress=False)
    return runner, hf, hf_tok, load_tokenizer(path)


def _prompts(tok) -> list[list[int]]:
    prompts = [tok.encode(t) for t in SHORT]
    long_ids = tok.encode(_long_text())
    assert len(long_ids) > max(LONG_TOKENS)
    return prompts + [long_ids[:n] for n in LONG_TOKENS]


def test_gemma3_tokenizer_matches_transformers(models):
    """Same ids as transformers' GGUF tokenizer, except on runs of spaces longer than 16: Gemma's whitespace
    runs (2 to 31 spaces) are USER_DEFINED pieces, which SentencePiece and llama.cpp match longest-first before
    any merge; transformers' GGUF conversion merges them as BPE pieces instead (74 spaces: 16+16+16+26)."""
    _, _, hf_tok, tok = models
    text = re.sub(" {17,}", " " * 16, _long_text()[:6000])
    for t in [*SHORT, text, "  two  spaces, tabs\tand émoji 🎉 日本語\n"]:
        assert tok.encode(t) == hf_tok.encode(t)
    run = tok.encode("a" + " " * 74 + "b", add_special_tokens=False)
    assert [len(tok.decode([i])) for i in run[1:-1]] == [31, 31, 12]


@pytest.fixture(scope="module")
def hf_reference(models):
    """Per prompt, transformers' last-position float32 logits and its 64 greedy tokens, from one prefill
    (logits of the last position only: all 1,500 positions x 262,144 would be 1.5 GB) continued on its own
    sliding-window KV cache; computed once for the module."""
    _, hf, _, tok = models
    return [_hf_greedy(hf, ids, 64) for ids in _prompts(tok)]


def test_gemma3_logits_and_greedy_match_transformers(models, hf_reference):
    runner, _, _, tok = models
    prompts = _prompts(tok)
    assert runner.arch.sliding_window == 512 and sum(w > 0 for w in runner.arch.layer_windows) == 15
    for ids, got, (want, _) in zip(prompts, _ragged_logits(runner, prompts, last_only=True), hf_reference, strict=True):
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-4, (len(ids), rel)
    ours = greedy_generate(runner, prompts, 64)
    for ids, got, (_, want_ids) in zip(prompts, ours, hf_reference, strict=True):
        assert got == want_ids, len(ids)


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' forward with its own (sliding-window) KV cache, argmax per step, no EOS stop: the prefill's
    last-position logits and the n greedy tokens."""
    o = hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    first = o.logits[0, -1].float()
    out, past = [int(first.argmax())], o.past_key_values
    while len(out) < n:
        o = hf(torch.tensor([[out[-1]]]), past_key_values=past, use_cache=True, logits_to_keep=1)
        past = o.past_key_values
        out.append(int(o.logits[0, -1].argmax()))
    return first, out


def test_gemma3_kept_blocks_match_dequantized(models):
    """--quantization gguf keeps Q4_K (int4) and Q8_0 (int8: embedding and tied head) codes and dequantizes
    Q5_0/Q6_K on load: the same weight values as the dequantized model up to the kernels' own formats. Under
    torch's kernels what remains (measured on 3 prompts: 2.3-5.2e-3 of the 5-10e-3 below) is the int4 pack's
    bfloat16 scale and zero per group of 32 (a Q4_K group's d * sc and 8 d * sc - dmin * m, 8 mantissa bits)
    and the rest bfloat16 activations; the head keeps its Q8_0 block scales (two per-channel int8 terms:
    re-rounded to one scale per row it alone gave 3.4e-2). The native kernels round activations to int8 per
    block of 32 as llama.cpp does (1.2-2.8e-2; tests/runtime/models/test_quant.py bounds that path)."""
    from runtime.models.registry import gemma3_model_path

    runner, _, _, tok = models
    kept = create_model_runner(make_config(model_path=gemma3_model_path(), dtype="float32", kv_cache_dtype="float32",
                                           quantization="gguf", quantization_kernel="torch", max_total_tokens=4096,
                                           disable_compile=True),
                               progress=False)
    from kernels import quant

    head = kept.model.lm_head
    assert isinstance(head, quant.Int8Weight) and head.codes2 is not None  # the tied Q8_0 table, block scales kept
    assert sum(isinstance(m, quant.QuantWeight) for m in kept.model.modules()) >= 1 + 18  # + Q4_K o_proj
    prompts = _prompts(tok)[:5]
    for got, want in zip(_ragged_logits(kept, prompts, last_only=True), _ragged_logits(runner, prompts, last_only=True), strict=True):
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 2e-2, rel
        assert got.argmax() == want.argmax()


def test_gemma3_prefix_hits_past_the_window_match_no_cache():
    """Through the scheduler (radix cache, chunked prefill of 256): questions over one ~1,500-token document,
    asked in turn so later ones hit the cached document (a prefix three windows long) and the previous
    answers' windows, give the same greedy tokens as an engine without the cache."""
    import runtime
    from runtime.models.registry import gemma3_model_path

    doc = _long_text()[:5000]
    prompts = [f"{doc}\n\nQuestion {i}: what is this document about?\nAnswer:" for i in range(3)]
    params = {"max_new_tokens": 24, "temperature": 0.0}
    outs = {}
    for disable in (False, True):
        eng = runtime.Engine(gemma3_model_path(), dtype="float32", kv_cache_dtype="float32", quantization="none",
                             max_total_tokens=8192, chunked_prefill_size=256, disable_radix_cache=disable,
                             disable_compile=True)
        try:
            outs[disable] = [eng.generate(p, params) for p in prompts]
        finally:
            eng.shutdown()
    cached = [o["meta_info"]["cached_tokens"] for o in outs[False]]
    assert cached[0] == 0 and min(cached[1:]) > 1024, cached
    assert [o["output_ids"] for o in outs[False]] == [o["output_ids"] for o in outs[True]]
