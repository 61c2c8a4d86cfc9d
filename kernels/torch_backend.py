"""The torch attention backend (CPU default): store new K/V into the pool, then attend.

Extend runs on torch's CPU flash kernel (kernels/torch_extend.py: mask-free passes over the batch's shared
prefix, each request's own prefix and its causal new tokens, merged by log-sum-exp). Decode attends for the whole
batch at once: each request's slots are gathered into a padded [B, L] block (L = longest sequence) and one
masked SDPA call with grouped KV heads covers every request, instead of B small calls per layer. When every
request of a decode batch shares a long cached prefix (same slots, from the radix cache), the prefix is read
once for the batch instead (kernels/cascade.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import ref, torch_extend
from kernels.api import AttnMetadata, BaseAttnBackend
from kernels.cascade import cascade_decode_attention, plan_cascade


class TorchAttnBackend(BaseAttnBackend):
    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        self.k_cache = k_cache  # [L, S, Hkv, D]
        self.v_cache = v_cache
        self.scale = scale
        self.use_cascade = True

    def init_forward(self, meta: AttnMetadata) -> None:
        self.meta = meta
        if meta.is_decode and meta.batch_size > 1:
            self._plan_decode(meta)

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        ref.store_kv(kc, vc, m.out_cache_loc, k, v)
        # CPU flash-kernel path (kernels/torch_extend.py); it falls back to ref.extend_attention off CPU.
        return torch_extend.extend_attention(
            q, kc, vc, m.req_to_token, m.req_pool_indices, m.prefix_lens_cpu, m.extend_lens_cpu, self.scale
        )

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        ref.store_kv(kc, vc, m.out_cache_loc, k, v)
        if m.batch_size == 1:
            return ref.decode_attention(
                q, kc, vc, m.req_to_token, m.req_pool_indices, m.seq_lens_cpu, self.scale
            )
        if self._cascade is not None:
            return cascade_decode_attention(q, kc, vc, self._cascade, self.scale)
        return padded_decode_attention(q, kc, vc, self._slots, self._mask, self.scale)

    def _plan_decode(self, m: AttnMetadata) -> None:
        longest = max(m.seq_lens_cpu)
        self._slots = m.req_to_token[m.req_pool_indices, :longest].long()  # [B, L]
        self._cascade = plan_cascade(self._slots, m.seq_lens) if self.use_cascade else None
        if self._cascade is not None:
            return
        pos = torch.arange(longest, device=m.seq_lens.device)
        self._mask = (pos.unsqueeze(0) < m.seq_lens.unsqueeze(1)).view(m.batch_size, 1, 1, longest)


def padded_decode_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, D]; kc, vc [S, Hkv, D]; slots [B, L] (padding slots are any valid index); mask [B, 1, 1, L]."""
    # No upcast: torch's CPU flash kernel takes bf16 inputs and accumulates in float32 itself; copying the
    # gathered K/V to float32 cost more than the attention (a third of a bf16 decode step).
    k = ref.gather_slots(kc, slots).transpose(1, 2)  # [B, Hkv, L, D]
    v = ref.gather_slots(vc, slots).transpose(1, 2)
    if k.dtype != q.dtype:  # a float16 pool under float32 q (--kv-cache-dtype float16): widened as read
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)  # [B, Hq, D]
