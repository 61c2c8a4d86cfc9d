"""The FlashInfer attention backend (CUDA only): paged prefill and decode wrappers planned once per step.

The pool is viewed as page size 1 in NHD layout: layer l's K is `k_cache[l].unsqueeze(1)`
([num_slots, 1, Hkv, D]), so kv_indices are simply each request's slots from req_to_token, concatenated,
and every last page holds exactly 1 token. That works for any slot layout (page size 1 or P).

`init_forward` builds kv_indices on the device (and the indptrs on the host, which `plan` wants there: a device
indptr would be read back, a sync); the wrapper `plan` runs at the first layer of the step (when q's head
count and dtype are known) and every later layer reuses it.

CUDA graphs (runtime/executor/cuda_graph.py): `init_cuda_graph_state` makes one decode wrapper per captured batch size
in FlashInfer's graph mode, over fixed indptr / indices / last-page buffers. `init_forward_graph` plans the
bucket's wrapper before each replay (outside the graph); plan copies the step's CSR into those fixed buffers,
which the captured kernels read. flashinfer is imported only when this backend is constructed.
"""

from __future__ import annotations

import torch

from kernels import ref
from kernels.api import AttnMetadata, BaseAttnBackend


def build_kv_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens_cpu: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR over slots: (kv_indptr [B+1] int32, kv_indices [sum seq_lens] int32), on req_to_token's device.

    kv_indices[kv_indptr[b] : kv_indptr[b+1]] == req_to_token[req_pool_indices[b], :seq_lens[b]].
    Uses only host lengths for sizes, so it does not sync with the device.
    """
    device = req_to_token.device
    lens_cpu = torch.tensor(seq_lens_cpu, dtype=torch.int64)
    indptr_cpu = host_indptr(seq_lens_cpu).long()
    total = int(indptr_cpu[-1])
    indptr = indptr_cpu.to(device)
    req = torch.repeat_interleave(
        torch.arange(len(seq_lens_cpu), device=device), lens_cpu.to(device), output_size=total
    )  # [total] request index of each entry
    pos = torch.arange(total, device=device) - indptr[req]  # [total] position within its request
    indices = req_to_token[req_pool_indices.to(device)[req], pos].to(torch.int32)
    return indptr.to(torch.int32), indices


def host_indptr(lens: tuple[int, ...]) -> torch.Tensor:
    """[len(lens) + 1] int32 exclusive prefix sums of `lens`, on the host."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=out[1:])
    return out


class FlashInferAttnBackend(BaseAttnBackend):
    supports_cuda_graph = True

    def __init__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, workspace_bytes: int = 128 << 20
    ) -> None:
        import flashinfer

        self.k_cache = k_cache  # [L, S, Hkv, D]
        self.v_cache = v_cache
        self.scale = scale
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=k_cache.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decoder = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._csr: tuple[torch.Tensor, ...] = ()
        self._planned = False
        self._graph_decoders: dict[int, object] = {}  # batch size -> graph-mode decode wrapper
        self._active_decoder = self.decoder
        self._num_q_heads = 0

    def init_forward(self, meta: AttnMetadata) -> None:
        self.meta = meta
        _, kv_indices = build_kv_indices(meta.req_to_token, meta.req_pool_indices, meta.seq_lens_cpu)
        last_page_len = torch.ones(meta.batch_size, dtype=torch.int32)
        self._csr = (host_indptr(meta.extend_lens_cpu), host_indptr(meta.seq_lens_cpu), kv_indices, last_page_len)
        self._active_decoder = self.decoder
        self._planned = False

    def init_cuda_graph_state(self, max_bs: int, buckets: tuple[int, ...], num_q_heads: int,
                              max_context: int) -> None:
        """Graph-mode decode wrappers, one per bucket, over fixed buffers sized for `max_bs` requests of up
        to `max_context` tokens (requests sharing a cached prefix list its slots once each)."""
        import flashinfer

        dev = self.k_cache.device
        self._num_q_heads = num_q_heads
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._g_indices = torch.zeros(max_bs * max_context, dtype=torch.int32, device=dev)
        self._g_last = torch.ones(max_bs, dtype=torch.int32, device=dev)
        for bs in buckets:
            self._graph_decoders[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=self._g_indptr[: bs + 1],
                paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last[:bs],
            )

    def init_forward_graph(self, meta: AttnMetadata) -> None:
        """Before a capture or replay of batch size meta.batch_size: plan that bucket's graph wrapper now,
        outside the graph (q's dtype is the pool's)."""
        self.init_forward(meta)
        self._active_decoder = self._graph_decoders[meta.batch_size]
        self._plan(self._num_q_heads, self.k_cache.dtype)

    def _plan(self, hq: int, q_dtype: torch.dtype) -> None:
        qo_indptr, kv_indptr, kv_indices, last_page_len = self._csr
        hkv, d = self.k_cache.shape[2], self.k_cache.shape[3]
        kv_dtype = self.k_cache.dtype
        if self.meta.is_decode:
            self._active_decoder.plan(
                kv_indptr, kv_indices, last_page_len, hq, hkv, d, 1,
                pos_encoding_mode="NONE", q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=self.scale,
            )
        else:
            self.prefill.plan(
                qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, 1,
                causal=True, sm_scale=self.scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )
        self._planned = True

    def _run(self, wrapper, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        kc, vc = self.k_cache[layer_id], self.v_cache[layer_id]
        ref.store_kv(kc, vc, self.meta.out_cache_loc, k, v)
        if not self._planned:
            self._plan(q.shape[1], q.dtype)
        return wrapper.run(q.contiguous(), (kc.unsqueeze(1), vc.unsqueeze(1)))

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return self._run(self.prefill, q, k, v, layer_id)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return self._run(self._active_decoder, q, k, v, layer_id)
