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

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.quant import QuantWeight
from kernels.quant.w8a8 import W8A8Weight, wrap_linears
from runtime.models.llama import LlamaForCausalLM

INT8_CLASSES = {"w_qkv": 0.5, "w_o": 0.5, "w_gate_up": 0.0, "lm_head": 0.5}  # class -> smoothing alpha
FLOAT_CHANNELS: dict[str, int] = {}  # class -> input channels run in float (kernels/quant/w8a8.py)
DENSE_CLASSES = ("w_down",)  # many-row calls: a dense GEMM on a kept copy in the model's dtype
SEED_TOKENS = (1, 504, 1000, 2000, 3000, 5000, 8000, 12000)
CALIBRATION_TOKENS = 48  # generated per seed


def _batched_causal_attend(batch: int) -> Callable[..., torch.Tensor]:
    """Attention over `batch` sequences of equal length laid end to end, no cache: q [B*L, Hq, D], k, v
    [B*L, Hkv, D] -> o [B*L, Hq, D] (causal within each sequence, grouped heads)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        qh, kh, vh = (t.unflatten(0, (batch, -1)).transpose(1, 2).float()
                      for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # [B, Hq, L, D]
        return o.transpose(1, 2).flatten(0, 1).to(q.dtype)

    return attend


def _logits(model: LlamaForCausalLM, seqs: list[list[int]]) -> torch.Tensor:
    """Equal-length sequences -> the logits of each one's last token [B, vocab]."""
    b, n = len(seqs), len(seqs[0])
    ids = torch.tensor([t for s in seqs for t in s])
    last = torch.arange(1, b + 1) * n - 1
    return model.forward_tokens(ids, torch.arange(n).repeat(b), last, _batched_causal_attend(b))


class _CachedAttend:
    """Greedy decoding of B sequences in lockstep with a K/V cache per layer: the first call takes the B seed
    tokens, each later call one new token per sequence. q [B, Hq, D], k, v [B, Hkv, D] -> o [B, Hq, D]."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, T, D]
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        kn, vn = k.float().unsqueeze(2), v.float().unsqueeze(2)
        if layer in self.k:
            kn, vn = torch.cat([self.k[layer], kn], 2), torch.cat([self.v[layer], vn], 2)
        self.k[layer], self.v[layer] = kn, vn
        rep = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(q.float().unsqueeze(2), kn.repeat_interleave(rep, 1),
                                           vn.repeat_interleave(rep, 1))  # [B, Hq, 1, D]
        return o.squeeze(2).to(q.dtype)


@torch.inference_mode()
def calibration_ids(model: LlamaForCausalLM, tokens: int = CALIBRATION_TOKENS,
                    seeds: tuple[int, ...] = SEED_TOKENS) -> list[list[int]]:
    """Each seed token followed by the model's greedy continuation of `tokens` tokens (exact kernels, before any
    int8 path), all seeds in lockstep over a K/V cache: one forward of B rows per token."""
    attend, b = _CachedAttend(), len(seeds)
    seqs = [[seed] for seed in seeds]
    for pos in range(tokens):
        ids = torch.tensor([s[-1] for s in seqs])
        nxt = model.forward_tokens(ids, torch.full((b,), pos), torch.arange(b), attend).argmax(-1).tolist()
        seqs = [s + [int(t)] for s, t in zip(seqs, nxt, strict=True)]
    return seqs


@torch.inference_mode()
def observe(model: LlamaForCausalLM, classes: tuple[str, ...], min_rows: int, seqs: list[list[int]]
            ) -> list[W8A8Weight]:
    """Wrap the `classes` linears of `model` (runtime.models.llama) in W8A8Weights and record each one's largest
    |input| per channel over `seqs` (one batched forward); returns them, codes not yet smoothed."""
    weights = wrap_linears(model, classes, min_rows)
    for w in weights:
        w.observe(True)
    try:
        _logits(model, seqs)
    finally:
        for w in weights:
            w.observe(False)
    return weights


def smooth_all(model: LlamaForCausalLM, alphas: dict[str, float], float_channels: dict[str, int]) -> None:
    """Re-round every W8A8Weight of the classes in `alphas` with that class's alpha and float channels."""
    for m in model.modules():
        for name, alpha in alphas.items():
            q = m._modules.get(name)
            if isinstance(q, W8A8Weight):
                assert isinstance(q.small, QuantWeight)  # wrap_linears wraps quantized weights only
                q.smooth(q.small.dequantize(), alpha, float_channels.get(name, 0))


@torch.inference_mode()
def setup_int8(model: LlamaForCausalLM, min_rows: int) -> list[W8A8Weight]:
    """Wrap the INT8_CLASSES linears of `model` in W8A8Weights and calibrate their smoothing; returns them.
    DENSE_CLASSES are left to the caller's dense copies."""
    weights = observe(model, tuple(INT8_CLASSES), min_rows, calibration_ids(model))
    smooth_all(model, INT8_CLASSES, FLOAT_CHANNELS)
    return weights
