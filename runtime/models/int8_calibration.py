"""--quantization w8a8_int8 at start-up: which linear classes run int8 arithmetic, and their smoothing calibrated once.

Measured on SmolLM2-135M (bench/results/quant_ppl_w8a8.md, held-out perplexity against the float model): per-token
int8 activations cost +4 % perplexity with plain per-channel weights, almost all of it from the inputs of q/k/v,
the lm_head, gate/up and down, whose few large channels leave the rest of a token few int8 levels. Per class:
  w_qkv, w_o, lm_head  int8 with SmoothQuant factors (alpha 0.5) from calibration text
  w_gate_up            int8, plain per-channel rounding (smoothing measured worse there)
  w_down               not int8: its input (SiLU(gate) * up) has per-token outliers that smoothing does not fix;
                       calls of many rows run one dense GEMM in the model's dtype on a kept copy, as --quantization
                       gguf does
Calibration: one forward of CALIBRATION_TOKENS tokens (the model's own greedy continuation of fixed seed tokens,
so it needs no tokenizer and no data set) through the exact small-batch kernels, recording each int8 linear's
largest |input| per channel; then every int8 weight is re-rounded from its exact source (the weight-only kernel's
dequantization) with its factors. Deterministic: same file, same factors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant import QuantWeight
from kernels.quant.w8a8 import W8A8Weight, wrap_linears
from runtime.models.llama import LlamaForCausalLM

INT8_CLASSES = {"w_qkv": 0.5, "w_o": 0.5, "w_gate_up": 0.0, "lm_head": 0.5}  # class -> smoothing alpha
DENSE_CLASSES = ("w_down",)  # many-row calls: a dense GEMM on a kept copy in the model's dtype
SEED_TOKENS = (1, 504, 1000, 2000, 3000, 5000, 8000, 12000)
CALIBRATION_TOKENS = 48  # generated per seed


def _causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """One sequence, no cache: q [T, Hq, D], k, v [T, Hkv, D] -> o [T, Hq, D] (causal, grouped heads)."""
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).float() for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1).to(q.dtype)


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids)
    return model.forward_tokens(t, torch.arange(len(ids)), torch.tensor([len(ids) - 1]), _causal_attend)


@torch.inference_mode()
def calibration_ids(model: LlamaForCausalLM) -> list[list[int]]:
    """Each seed token followed by the model's greedy continuation (exact kernels, before any int8 path)."""
    out = []
    for seed in SEED_TOKENS:
        ids = [seed]
        for _ in range(CALIBRATION_TOKENS):
            ids.append(int(_logits(model, ids)[-1].argmax()))
        out.append(ids)
    return out


@torch.inference_mode()
def setup_int8(model: LlamaForCausalLM, min_rows: int) -> list[W8A8Weight]:
    """Wrap the INT8_CLASSES linears of `model` (runtime.models.llama) in W8A8Weights and calibrate their smoothing;
    returns them. DENSE_CLASSES are left to the caller's dense copies."""
    seqs = calibration_ids(model)
    weights = wrap_linears(model, tuple(INT8_CLASSES), min_rows)
    for w in weights:
        w.observe(True)
    try:
        for ids in seqs:
            _logits(model, ids)
    finally:
        for w in weights:
            w.observe(False)
    for m in model.modules():
        for name, alpha in INT8_CLASSES.items():
            q = m._modules.get(name)
            if isinstance(q, W8A8Weight):
                assert isinstance(q.small, QuantWeight)  # wrap_linears wraps quantized weights only
                q.smooth(q.small.dequantize(), alpha)
    return weights
