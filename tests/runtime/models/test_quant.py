"""Quantized weights end to end: config resolution, the loader's choices, the packed model weights against the
float model's, greedy "Paris" in every CPU mode, round-to-nearest on a safetensors checkpoint, loud refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kernels import quant
from runtime.config import make_config, resolve
from runtime.executor.greedy import greedy_generate
from runtime.executor.model_runner import create_model_runner
from runtime.models.loader import load_weights
from runtime.models.quant_policy import UnsupportedQuantization
from tests.kernels.native import require_native_blocks


def _resolved(**kw):
    return resolve(make_config(device="cpu", **kw)).model


@pytest.mark.parametrize("native_bf16", [True, False])
def test_resolve_quantization_defaults(native_bf16, monkeypatch) -> None:
    from runtime import config

    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    want = "bfloat16" if native_bf16 else "float32"  # the model's dtype follows the CPU, quantized or not
    m = _resolved()
    assert (m.quantization, m.dtype) == ("gguf", want)  # the default GGUF keeps its blocks
    again = resolve(make_config(**resolve(make_config(device="cpu")).to_dict()))  # as a child process does
    assert again.model == m
    assert _resolved(dtype="float32").quantization == "none"  # exact float runs stay float
    assert _resolved(model_path="/some/hf_dir").quantization == "none"
    assert _resolved(model_path="/some/hf_dir", quantization="int4").dtype == want
    # the KV cache: float16 under a float32 model with quantized weights, else the model's dtype
    assert m.kv_cache_dtype == ("bfloat16" if native_bf16 else "float16")
    assert _resolved(dtype="float32").kv_cache_dtype == "float32"
    assert _resolved(quantization="none").kv_cache_dtype == want
    assert _resolved(dtype="float32", kv_cache_dtype="float16").kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 cannot run with --dtype bfloat16"):
        _resolved(dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="unknown --kv-cache-dtype"):
        _resolved(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="fp8 needs CUDA"):
        _resolved(quantization="fp8")
    with pytest.raises(ValueError, match="unknown --quantization"):
        _resolved(quantization="awq")


def _paris_prompt(hf_smollm) -> list[int]:
    """With a system line: the bare question sits on a tie at bf16 resolution for this 135M Q4_1 model ('The'
    vs 'L' at -1.92 under the int4 kernel; the dense bf16 model flips the same way on a reworded question)."""
    tok = hf_smollm[1]
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
    return tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("mode,kernel", [("auto", "native"), ("auto", "torch"), ("int8", "native"),
                                         ("int8", "torch")])
def test_quantized_smollm_answers_paris(mode: str, kernel: str, smollm_path, smollm_runner, hf_smollm) -> None:
    """auto keeps the file's Q4_1 codes (int4 kernel) and its Q8_0 embedding; int8 re-rounds every linear per
    channel. The fused QKV weight (Q/K rows un-permuted) dequantizes to the float model's within the bf16
    rounding of the f16 scales (auto) or half an int8 step (int8); greedy decoding still answers Paris, under
    torch's weight-only kernels and the native block kernels (--quantization-kernel) alike."""
    if kernel == "native":
        require_native_blocks()
    runner = create_model_runner(make_config(model_path=smollm_path, max_total_tokens=512, quantization=mode,
                                             quantization_kernel=kernel), progress=False)
    from runtime.config import cpu_has_native_bf16

    assert runner.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    ref_w = smollm_runner.model.layers[3].w_qkv  # dense float32: a Parameter, or column panels on AVX2 CPUs
    ref = (ref_w.dequantize() if isinstance(ref_w, quant.PanelWeight) else ref_w).float()
    w = runner.model.layers[3].w_qkv
    kinds = {("auto", "torch"): quant.Int4Weight, ("int8", "torch"): quant.Int8Weight,
             ("auto", "native"): quant.Q4BlockWeight, ("int8", "native"): quant.Q8BlockWeight}
    assert isinstance(w, kinds[mode, kernel])
    err = (w.dequantize() - ref).abs().max().item()
    assert err <= (2**-8 if mode == "auto" else 2**-6) * ref.abs().max().item(), err
    # the quantized weights read by a batch-1 step; batched calls use copies in the model's dtype
    # (--quantization-dense-rows); smollm_runner is the float32 model. Under torch's kernels the tied Q8_0 head
    # is two int8 terms (its block scales kept: kernels.quant.to_kernel), 0.36 of the float model in all
    assert runner.weights_bytes - runner.dense_copy_bytes < smollm_runner.weights_bytes * 0.4
    share = runner.dtype.itemsize / torch.float32.itemsize
    assert 0 < runner.dense_copy_bytes <= smollm_runner.weights_bytes * share  # at most every weight, once
    out = greedy_generate(runner, [_paris_prompt(hf_smollm)], 12, runner.eos_token_ids)[0]
    assert "Paris" in hf_smollm[1].decode(out)


def _tiny_llama(tmp_path, quant_cfg: dict | None = None) -> str:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
                         tie_word_embeddings=False)
    path = str(tmp_path / "tiny")
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    if quant_cfg is not None:
        with open(os.path.join(path, "config.json")) as fh:
            c = json.load(fh)
        c["quantization_config"] = quant_cfg
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(c, fh)
    return path


def test_safetensors_round_to_nearest_on_load(tmp_path) -> None:
    """bf16/fp32 safetensors quantized on load: int4 with the asked group, int8 per channel; the loaded codes
    reproduce the float weights within half a step, and the forward stays close to the float forward."""
    path = _tiny_llama(tmp_path)
    _, dense = load_weights(path, torch.float32, progress=False)
    name = "model.layers.1.mlp.down_proj.weight"
    for mode, group in (("int4", 32), ("int4", 64), ("int8", 0)):
        _, weights = load_weights(path, torch.float32, False, mode, group or 32)
        q = weights[name]
        assert isinstance(q, quant.QTensor) and q.kind == mode and q.group == (group or q.shape[1])
        step = q.scale.repeat_interleave(q.group, dim=1)
        assert ((q.dequantize() - dense[name]).abs() <= step / 2 + 1e-6).all()
        assert isinstance(weights["model.embed_tokens.weight"], torch.Tensor)  # embeddings stay float
        assert weights["lm_head.weight"].kind == "int8"
    logits = {}
    ids = [[5, 17, 42, 7, 99, 3]]
    for mode in ("none", "int4", "int8"):
        runner = create_model_runner(make_config(model_path=path, max_total_tokens=64, quantization=mode,
                                                 dtype="float32"), progress=False)
        from runtime.executor.greedy import OfflineBatch

        batch = OfflineBatch(runner, ids)
        logits[mode] = batch.extend(ids)
        batch.release()
    for mode in ("int4", "int8"):
        cos = torch.nn.functional.cosine_similarity(logits[mode], logits["none"], dim=-1).min().item()
        assert cos > (0.99 if mode == "int4" else 0.999), (mode, cos)


def test_quantized_checkpoints_are_refused(tmp_path) -> None:
    path = _tiny_llama(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedQuantization, match="quantized with 'gptq', which radixgen cannot load"):
        load_weights(path, torch.float32, progress=False)


def test_w8a8_int8_serves_smollm(smollm_path, hf_smollm, tmp_path) -> None:
    """--quantization w8a8_int8: every int8 linear keeps its GGUF weight-only kernel for calls of < 8 rows and gets int8
    codes per channel for the int8 arithmetic above; greedy decoding of a batch that crosses the threshold (a
    9-row prefill, then 9-row decode steps, all int8) answers Paris, and the 1-row prompt alone (weight-only
    decode) too. A second start reads the calibration record the first stored and rounds the same codes."""
    cfg = make_config(model_path=smollm_path, max_total_tokens=1024, quantization="w8a8_int8",
                      compile_cache_dir=str(tmp_path))
    runner = create_model_runner(cfg, progress=False)
    assert runner.int8_calibration == "computed"
    assert runner.int8_linears == 30 * 4 + 1 and runner.dense_copy_bytes == 0  # every linear class runs int8
    w = runner.model.layers[3].w_qkv
    assert isinstance(w, quant.W8A8Weight) and w.min_rows == 8
    assert isinstance(w.small, (quant.Int4Weight, quant.Q4BlockWeight))  # the 4-bit kernel this CPU runs
    gu = runner.model.layers[3].w_gate_up
    assert w.inv_s is not None and gu.inv_s is not None  # smoothed, with float input channels (int8_calibration)
    assert w.fidx is not None and w.fidx.numel() == 8 and gu.fidx is not None and gu.fidx.numel() == 16
    assert w.small.dense is None  # the calibration's float32 copies are dropped
    down = runner.model.layers[3].w_down
    assert isinstance(down, quant.W8A8Weight) and down.fidx is not None and down.fidx.numel() == 128
    assert isinstance(down.small, quant.QuantWeight) and down.small.dense is None
    # int8 codes round the file's 4-bit values (times the smoothing factors): within half a step per element
    err = (w.dequantize() - w.small.dequantize()).abs()
    assert (err <= (w.sw[:, None] / 2) * w.inv_s[None, :] + 1e-6).all()
    # the chat prompt's first token is a near tie ('The' vs 'La': 0.2 nats apart under the weight-only kernels,
    # 0.001 under int8), so the int8 batch continues a sentence whose answer leads by 2.5 nats under both
    prompt = hf_smollm[1].encode("The capital of France is")
    outs = greedy_generate(runner, [prompt] * 9, 12, runner.eos_token_ids)
    assert all(hf_smollm[1].decode(o).startswith(" Paris") for o in outs)
    assert all(o == outs[0] for o in outs)  # rows are batch-invariant under int8
    alone = greedy_generate(runner, [prompt[-1:]], 1)  # one row: the weight-only kernels
    assert len(alone[0]) == 1
    again = create_model_runner(cfg, progress=False)
    assert again.int8_calibration == "cache"
    first = dict(runner.model.named_modules())
    for name, m in again.model.named_modules():
        if isinstance(m, quant.W8A8Weight):
            ref = first[name]
            assert isinstance(ref, quant.W8A8Weight)
            for attr in ("wt", "sw", "inv_s", "fidx", "wf"):
                a, b = getattr(m, attr), getattr(ref, attr)
                assert (a is None and b is None) or torch.equal(a, b), (name, attr)
    with pytest.raises(ValueError, match="w8a8_int8 runs on CPU only"):
        resolve(make_config(device="cuda", quantization="w8a8_int8"))
    with pytest.raises(ValueError, match="--quantization-int8-rows must be >= 1"):
        _resolved(quantization="w8a8_int8", quantization_int8_rows=0)
    assert _resolved(quantization="w8a8_int8").quantization == "w8a8_int8"
