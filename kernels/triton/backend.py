"""The Triton attention backend: store new K/V with a Triton kernel, then Triton extend / decode attention.

Same contract as kernels/torch_backend.py (the reference): `init_forward(meta)` once per step builds the
per-step device metadata (qo_start for extend; decode scratch reused across layers and steps), then each layer
calls `extend` or `decode`. Decode launches depend only on (B, Hkv, num_kv_splits), never on host lengths,
and read only the metadata tensors and the preallocated split scratch, so a decode step can be captured in
a CUDA graph (`supports_cuda_graph`; runtime/executor/cuda_graph.py) once `init_cuda_graph_state` has sized the scratch.
"""

from __future__ import annotations

import torch

from kernels.api import AttnMetadata, BaseAttnBackend
from kernels.triton.decode_attention import alloc_decode_scratch, decode_attention
from kernels.triton.extend_attention import extend_attention
from kernels.triton.store_kv import store_kv


class TritonAttnBackend(BaseAttnBackend):
    supports_cuda_graph = True

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 num_kv_splits: int | None = None) -> None:
        """num_kv_splits: decode splits per request; default 8 on a GPU, 2 on a CPU, where Triton runs only
        under TRITON_INTERPRET and executes the programs one after another (more splits add work without
        parallelism; 2 still exercises the split merge)."""
        self.k_cache = k_cache  # [L, S, Hkv, D]
        self.v_cache = v_cache
        self.scale = scale
        self.num_kv_splits = num_kv_splits or (8 if k_cache.device.type == "cuda" else 2)
        self._qo_start: torch.Tensor | None = None  # [B] exclusive cumsum of extend_lens (extend only)
        self._max_extend = 0
        self._mid: tuple[torch.Tensor, torch.Tensor] | None = None  # decode split scratch, grown on demand

    def init_forward(self, meta: AttnMetadata) -> None:
        self.meta = meta
        if not meta.is_decode:
            self._qo_start = torch.cumsum(meta.extend_lens, 0) - meta.extend_lens
            self._max_extend = max(meta.extend_lens_cpu, default=0)

    def init_cuda_graph_state(self, max_bs: int, buckets: tuple[int, ...], num_q_heads: int,
                              max_context: int) -> None:
        """Allocate the decode scratch for `max_bs` before capture, so captured graphs and eager steps share
        one buffer that no later step reallocates."""
        d = self.k_cache.shape[-1]
        self._mid = alloc_decode_scratch(max_bs, num_q_heads, d, self.num_kv_splits, self.k_cache.device)
        self._graph_mid = self._mid  # captured graphs hold its address: keep it alive even if _mid regrows

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        store_kv(kc, vc, m.out_cache_loc, k, v)
        assert self._qo_start is not None  # init_forward set it: this step has extend rows
        return extend_attention(
            q, kc, vc, m.req_to_token, m.req_pool_indices, m.prefix_lens, m.extend_lens,
            self._qo_start, self._max_extend, self.scale,
        )

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        store_kv(kc, vc, m.out_cache_loc, k, v)
        return decode_attention(
            q, kc, vc, m.req_to_token, m.req_pool_indices, m.seq_lens, self.scale,
            num_kv_splits=self.num_kv_splits, mid=self._scratch(q),
        )

    def _scratch(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, hq, d = q.shape
        mid = self._mid
        if mid is None or mid[0].shape[0] < bsz or mid[0].shape[1] != hq or mid[0].shape[3] != d:
            mid = self._mid = alloc_decode_scratch(max(bsz, 1), hq, d, self.num_kv_splits, q.device)
        return mid
