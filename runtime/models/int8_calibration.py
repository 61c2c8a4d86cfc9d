"""--quantization w8a8_int8 at start-up: which linear classes run int8 arithmetic, and their smoothing calibrated once.

Measured on SmolLM2-135M (bench/int8_accuracy.py on 6,138 held-out tokens; bench/results/quant_ppl_w8a8.md over
20,460): per-token int8 activations cost +4 % perplexity with plain per-channel weights, almost all of it from a few
large input channels that leave the rest of a token few int8 levels. SmoothQuant (alpha 0.5) alone left +2.05 %;
taking the largest smoothed input channels out of the int8 path (they run a small float GEMM, kernels/quant/w8a8.py)
brings it to +0.27 %. Per class (alpha / float channels; each class alone int8, the rest float, smoothing only):
  w_qkv      0.5 / 8    (+0.45 % with smoothing only)
  w_o        0.5 / 8    (+0.19 %)
  w_gate_up  0.5 / 16   (+0.74 % plain rounding; 0.5 / 16 alone +0.13 %)
  lm_head    0.5 / 8    (+0.76 %)
  w_down     0 / 128 (its input, SiLU(gate) * up, has per-token outliers: smoothing at 0.5 left +0.61 % alone with
             16 float channels; plain rounding with the 128 largest of its 1,536 input channels in float costs
             +0.20 % on top of the other classes, 12 held-out windows)
Calibration: the model's own greedy continuation of fixed seed tokens (CALIBRATION_TOKENS each, all seeds decoded in
lockstep over a K/V cache; it needs no tokenizer and no data set), then one batched forward of that text recording
each int8 linear's largest |input| per channel; then every int8 weight is re-rounded from its exact source (the
weight-only kernel's dequantization) with its factors. Both passes run dense float32 GEMMs on transient copies of the
dequantized weights (the same values; the 4-bit kernels are GEMVs, ~10x slower at 8 rows per call), dropped after.
Deterministic: same file, same factors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels.quant import QuantWeight, keep_dense_copies
from kernels.quant.w8a8 import W8A8Weight, wrap_linears
from runtime.models.llama import LlamaForCausalLM

INT8_CLASSES = {"w_qkv": 0.5, "w_o": 0.5, "w_gate_up": 0.5, "w_down": 0.0, "lm_head": 0.5}  # class -> smoothing alpha
FLOAT_CHANNELS = {"w_qkv": 8, "w_o": 8, "w_gate_up": 16, "w_down": 128, "lm_head": 8}  # class -> float input channels
DENSE_CLASSES: tuple[str, ...] = ()  # classes whose many-row calls run a dense GEMM on a kept copy instead
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
    """Wrap the `classes` linears of `model` (runtime.models.llama) in W8A8Weights (those not wrapped yet) and
    record each one's largest |input| per channel over `seqs` (one batched forward); returns them, codes not yet
    smoothed."""
    wrap_linears(model, classes, min_rows)
    weights = [w for m in model.modules() for c in classes if isinstance(w := m._modules.get(c), W8A8Weight)]
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


class AmaxStore(Protocol):
    """Where calibration's record can be kept between starts (runtime/executor/calibration_cache.py)."""

    def load(self, shapes: dict[str, int]) -> dict[str, torch.Tensor] | None:
        """The record for these linears (module name -> in_features), checked, or None."""
        ...

    def save(self, amax: dict[str, torch.Tensor]) -> None: ...


def int8_weights(model: LlamaForCausalLM) -> dict[str, W8A8Weight]:
    """Every W8A8Weight of `model` by its module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, W8A8Weight)}


@torch.inference_mode()
def setup_int8(model: LlamaForCausalLM, min_rows: int, store: AmaxStore | None = None) -> list[W8A8Weight]:
    """Wrap the INT8_CLASSES linears of `model` in W8A8Weights and calibrate their smoothing; returns them.
    DENSE_CLASSES are left to the caller's dense copies. With a `store`, a record it holds for these linears
    replaces calibration's two forward passes, and a record computed here is saved to it."""
    wrap_linears(model, tuple(INT8_CLASSES), min_rows)
    named = int8_weights(model)
    amax = store.load({n: w.in_features for n, w in named.items()}) if store is not None else None
    if amax is None:
        kept = {m: (m.dense, m.dense_min_rows) for m in model.modules()
                if isinstance(m, QuantWeight) and not isinstance(m, W8A8Weight)}
        keep_dense_copies(model, 1, torch.float32)  # transient (module doc)
        try:
            observe(model, tuple(INT8_CLASSES), min_rows, calibration_ids(model))
        finally:
            for m, (dense, rows) in kept.items():
                m.dense, m.dense_min_rows = dense, rows
        amax = {n: w.amax for n, w in named.items() if w.amax is not None}
        if store is not None:
            store.save(amax)
    for n, w in named.items():
        w.amax = amax[n]
    smooth_all(model, INT8_CLASSES, FLOAT_CHANNELS)
    return list(named.values())
