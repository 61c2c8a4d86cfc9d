"""Test helper: a minimal paged-KV Llama forward over a transformers LlamaForCausalLM's weights.

Only attention goes through `kernels.create_attn_backend(name, ...)`; norms and rope use kernels.ref, so
comparing runs across backend names isolates the attention backends. KV pool and table follow
runtime.executor.memory's layout: K/V [L, S, Hkv, D], req_to_token [B, max_context] int32, pages of `page_size`
slots handed to requests in a scattered order.
"""

from __future__ import annotations

import torch

from kernels import create_attn_backend, ref
from kernels.api import AttnMetadata


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


class PagedLlama:
    def __init__(self, hf_model, backend: str, num_slots: int, max_pos: int = 4096) -> None:
        cfg = hf_model.config
        self.hf = hf_model
        self.device = next(hf_model.parameters()).device
        self.hq = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        self.eps = cfg.rms_norm_eps
        dtype = next(hf_model.parameters()).dtype
        shape = (cfg.num_hidden_layers, num_slots, self.hkv, self.hd)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.attn = create_attn_backend(backend, self.k_cache, self.v_cache, self.hd**-0.5)
        scaling = getattr(cfg, "rope_scaling", None)
        scaling = scaling if scaling and scaling.get("rope_type", "default") != "default" else None
        self.cos_sin = ref.rope_cos_sin(self.hd, max_pos, _rope_theta(cfg), scaling, device=self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns float32 logits [B, vocab] of each request's last new token."""
        m = self.hf.model
        t = input_ids.shape[0]
        self.attn.init_forward(meta)
        h, residual = m.embed_tokens(input_ids), None
        for i, layer in enumerate(m.layers):
            x, residual = ref.rmsnorm(h, layer.input_layernorm.weight, self.eps, residual)
            sa = layer.self_attn
            q = sa.q_proj(x).view(t, self.hq, self.hd)
            k = sa.k_proj(x).view(t, self.hkv, self.hd)
            v = sa.v_proj(x).view(t, self.hkv, self.hd)
            q, k = ref.apply_rope(q, k, positions, self.cos_sin)
            o = (self.attn.decode if meta.is_decode else self.attn.extend)(q, k, v, i)
            h = sa.o_proj(o.reshape(t, self.hq * self.hd))
            x, residual = ref.rmsnorm(h, layer.post_attention_layernorm.weight, self.eps, residual)
            h = layer.mlp(x)
        x, _ = ref.rmsnorm(h, m.norm.weight, self.eps, residual)
        last = torch.cumsum(meta.extend_lens, 0) - 1
        return self.hf.lm_head(x[last]).float()


class GreedyRun:
    """Prefill each prompt in two chunks (prefix 0, then an extend over the cached half), then decode."""

    def __init__(self, model: PagedLlama, page_size: int, seed: int = 0) -> None:
        self.model = model
        self.page_size = page_size
        self.gen = torch.Generator().manual_seed(seed)

    def run(self, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[float]]]:
        """Returns (greedy tokens per request, top1 - top2 logit margin at each of those tokens)."""
        dev, p = self.model.device, self.page_size
        b = len(prompts)
        ctx = max(len(x) for x in prompts) + max_new
        pages_per_req = -(-ctx // p)
        assert b * pages_per_req * p <= self.model.k_cache.shape[1], "pool too small"
        pages = torch.randperm(b * pages_per_req, generator=self.gen).view(b, pages_per_req)
        r2t = (pages[:, :, None] * p + torch.arange(p)).view(b, -1)[:, :ctx].to(torch.int32).to(dev)
        rows = torch.arange(b, device=dev)
        half = [len(x) // 2 for x in prompts]
        self._step(r2t, rows, [x[:h] for x, h in zip(prompts, half, strict=True)], [0] * b, False)
        logits = self._step(
            r2t, rows, [x[h:] for x, h in zip(prompts, half, strict=True)], half, False
        )
        lens = [len(x) for x in prompts]
        tokens: list[list[int]] = [[] for _ in range(b)]
        margins: list[list[float]] = [[] for _ in range(b)]
        for step in range(max_new):
            top = logits.topk(2, dim=-1)
            nxt = top.indices[:, 0].tolist()
            for i in range(b):
                tokens[i].append(nxt[i])
                margins[i].append(float(top.values[i, 0] - top.values[i, 1]))
            if step + 1 < max_new:
                logits = self._step(r2t, rows, [[x] for x in nxt], [n + step for n in lens], True)
        return tokens, margins

    def _step(self, r2t, rows, new: list[list[int]], prefix: list[int], is_decode: bool) -> torch.Tensor:
        dev = self.model.device
        extend = [len(x) for x in new]
        seq = [a + e for a, e in zip(prefix, extend, strict=True)]
        loc = torch.cat([r2t[i, a:s] for i, (a, s) in enumerate(zip(prefix, seq, strict=True))]).long()
        pos = torch.tensor([j for a, s in zip(prefix, seq, strict=True) for j in range(a, s)], device=dev)
        ids = torch.tensor([t for x in new for t in x], device=dev)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        meta = AttnMetadata(
            num_decode=len(extend) if is_decode else 0, req_to_token=r2t, req_pool_indices=rows, seq_lens=t(seq),
            prefix_lens=t(prefix), extend_lens=t(extend), out_cache_loc=loc, seq_lens_cpu=tuple(seq),
            prefix_lens_cpu=tuple(prefix), extend_lens_cpu=tuple(extend),
        )
        return self.model.forward(ids, pos, meta)
