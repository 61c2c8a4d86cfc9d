"""SamplingInfo: one step's per-request sampling parameters as batched tensors.

Built by the scheduler every step from the running requests (their SamplingParams, the tokens they have
produced so far, their step index, their stop ids), then handed with the logits to `sampler.sample`.
Every optional feature (penalties, logit bias, min_new_tokens, top-k/top-p/min-p) is left as None / False
when no request in the batch uses it, so the common batch pays only for what it asks.

Seeds: request b draws its randomness from a generator seeded by mix(seed_b, steps[b]) only, so the same
request samples the same token whatever its batch neighbours are. seed_b is, in order: `seeds[b]` when the
caller passes `seeds`; else `params[b].sampling_seed`; else mix(default_seed, b). The last fallback depends
on the row index, so it is not batch-independent: a scheduler that wants unseeded requests to be
reproducible too derives a seed per request at admission and passes `seeds`.

Penalties (SGLang semantics, applied to the request's OUTPUT tokens only, not its prompt):
repetition first (a seen token's logit is divided by the penalty when positive, multiplied when negative),
then frequency (minus penalty * count) and presence (minus penalty once seen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.executor.staging import to_device
from runtime.sampling.params import GREEDY_EPS, SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step): splitmix64 finalizer over both."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingInfo:
    """Batched sampling parameters for B requests over a vocabulary of V.

    Shapes: temperatures/top_ps/min_ps float32 [B]; top_ks int64 [B] (V where disabled); is_greedy bool [B];
    penalty tensors float32 [B] and `counts` float32 [B, V] (output-token counts), present only when a
    request uses that penalty; `logit_bias` float32 [B, V] only when a request has a bias;
    `min_tokens_rows`/`min_tokens_ids` int64 [N]: the (row, token) pairs masked to -inf this step because
    the row has produced fewer than min_new_tokens tokens. Greedy rows have temperature 1 in the tensor
    (their result is an argmax, temperature never divides them).
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    is_greedy: torch.Tensor
    is_all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    seeds: list[int]
    steps: list[int]
    greedy_rows: list[bool]
    top_k_list: list[int]  # host copies of top_ks / top_ps: the sampler picks rows without reading the device
    top_p_list: list[float]
    counts: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_ids: torch.Tensor | None = None

    @property
    def needs_processing(self) -> bool:
        """True when logits must be changed before the argmax/sampling (penalties, bias, min tokens)."""
        return self.counts is not None or self.logit_bias is not None or self.min_tokens_rows is not None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        steps: list[int],
        vocab_size: int,
        stop_ids: list[list[int]],
        default_seed: int,
        device: str | torch.device = "cpu",
        seeds: list[int] | None = None,
    ) -> SamplingInfo:
        """Tensors for one step. `steps[b]`: index of the token request b samples now (normally
        len(output_ids[b])); `stop_ids[b]`: the ids that end request b (EOS unless ignore_eos, plus
        stop_token_ids), masked while len(output_ids[b]) < params[b].min_new_tokens."""
        B, V = len(params), vocab_size
        if not (len(output_ids) == len(steps) == len(stop_ids) == B) or (seeds is not None and len(seeds) != B):
            raise ValueError("SamplingInfo.build: per-request lists must all have the batch size")
        dev = torch.device(device)
        greedy = [p.temperature < GREEDY_EPS or p.top_k == 1 for p in params]
        ks = [V if (p.top_k <= 0 or p.top_k >= V) else p.top_k for p in params]
        if seeds is None:
            seeds = [
                p.sampling_seed if p.sampling_seed is not None else mix_seed(default_seed, b)
                for b, p in enumerate(params)
            ]
        sampled = [not g for g in greedy]
        info = cls(
            batch_size=B,
            vocab_size=V,
            device=dev,
            temperatures=to_device([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                                   torch.float32, dev),
            top_ps=to_device([p.top_p for p in params], torch.float32, dev),
            top_ks=to_device(ks, torch.int64, dev),
            min_ps=to_device([p.min_p for p in params], torch.float32, dev),
            is_greedy=to_device(greedy, torch.bool, dev),
            is_all_greedy=all(greedy),
            need_top_k=any(s and k < V for s, k in zip(sampled, ks, strict=True)),
            need_top_p=any(s and p.top_p < 1.0 for s, p in zip(sampled, params, strict=True)),
            need_min_p=any(s and p.min_p > 0.0 for s, p in zip(sampled, params, strict=True)),
            seeds=list(seeds),
            steps=list(steps),
            greedy_rows=greedy,
            top_k_list=ks,
            top_p_list=[p.top_p for p in params],
        )
        info._build_penalties(params, output_ids)
        info._build_bias(params)
        rows = [b for b, p in enumerate(params) if len(output_ids[b]) < p.min_new_tokens for _ in stop_ids[b]]
        if rows:
            ids = [t for b, p in enumerate(params) if len(output_ids[b]) < p.min_new_tokens for t in stop_ids[b]]
            info.min_tokens_rows = to_device(rows, torch.int64, dev)
            info.min_tokens_ids = to_device(ids, torch.int64, dev)
        return info

    def _build_penalties(self, params: list[SamplingParams], output_ids: list[list[int]]) -> None:
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        use_rep, use_freq, use_pres = any(r != 1.0 for r in rep), any(freq), any(pres)
        if not (use_rep or use_freq or use_pres) or not any(output_ids):
            return
        B, V, dev = self.batch_size, self.vocab_size, self.device
        rows = torch.tensor([b for b, ids in enumerate(output_ids) for _ in ids], dtype=torch.int64)
        cols = torch.tensor([t for ids in output_ids for t in ids], dtype=torch.int64)
        counts = torch.zeros(B * V, dtype=torch.float32)
        counts.index_add_(0, rows * V + cols, torch.ones(cols.numel(), dtype=torch.float32))
        self.counts = to_device(counts.view(B, V), torch.float32, dev)

        def col(xs: list[float]) -> torch.Tensor:
            return to_device(xs, torch.float32, dev)

        self.repetition_penalties = col(rep) if use_rep else None
        self.frequency_penalties = col(freq) if use_freq else None
        self.presence_penalties = col(pres) if use_pres else None

    def _build_bias(self, params: list[SamplingParams]) -> None:
        if not any(p.logit_bias for p in params):
            return
        bias = torch.zeros((self.batch_size, self.vocab_size), dtype=torch.float32)
        for b, p in enumerate(params):
            for key, value in (p.logit_bias or {}).items():
                bias[b, int(key)] += float(value)
        self.logit_bias = to_device(bias, torch.float32, self.device)
