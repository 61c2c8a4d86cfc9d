"""The torch attention backend (CPU default): store new K/V into the pool, then the reference attention."""

from __future__ import annotations

import torch

from kernels import ref
from kernels.api import AttnMetadata


class TorchAttnBackend:
    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        self.k_cache = k_cache  # [L, S, Hkv, D]
        self.v_cache = v_cache
        self.scale = scale
        self.meta: AttnMetadata | None = None

    def init_forward(self, meta: AttnMetadata) -> None:
        self.meta = meta

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        ref.store_kv(kc, vc, m.out_cache_loc, k, v)
        return ref.extend_attention(
            q, kc, vc, m.req_to_token, m.req_pool_indices, m.prefix_lens_cpu, m.extend_lens_cpu, self.scale
        )

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        ref.store_kv(kc, vc, m.out_cache_loc, k, v)
        return ref.decode_attention(q, kc, vc, m.req_to_token, m.req_pool_indices, m.seq_lens_cpu, self.scale)
