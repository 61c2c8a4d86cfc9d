"""The attention seam between the model and its kernels.

Data flow per forward: the model runner builds one `AttnMetadata` from the batch, calls
`backend.init_forward(meta)` once, then each attention layer calls `extend(...)` or `decode(...)` with its
new q/k/v. The backend first stores the new K/V into the paged pool at `meta.out_cache_loc`, then attends
over each request's whole sequence (cached prefix + new tokens), reading slots through `req_to_token`.

Pool layout: `k_cache`, `v_cache` are `[num_layers, num_slots, num_kv_heads, head_dim]`.
Slot 0.. are real slots; a page of size P holds slots [p*P, (p+1)*P).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttnMetadata:
    """Per-step attention inputs (built once per forward, immutable).

    B = requests in the batch, T = new tokens in the batch (T == B in decode).
    Invariant: seq_lens == prefix_lens + extend_lens; sum(extend_lens) == T.
    """

    is_decode: bool
    req_to_token: torch.Tensor  # [max_running, max_context] int32: (row, position) -> slot
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64 tokens per request after this step
    prefix_lens: torch.Tensor  # [B] int64 tokens already in the pool before this step
    extend_lens: torch.Tensor  # [B] int64 new tokens per request (all 1 in decode)
    out_cache_loc: torch.Tensor  # [T] int64 slot of each new token
    seq_lens_cpu: tuple[int, ...]  # host copies, for kernels that plan on the host
    prefix_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


class BaseAttnBackend(Protocol):
    """What the model calls per attention layer. q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D].

    Invariant: after `extend`/`decode` returns, the new k/v are in the pool at `meta.out_cache_loc`
    for `layer_id` (later steps read them from there).
    """

    def init_forward(self, meta: AttnMetadata) -> None: ...

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor: ...

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor: ...


# CUDA graphs (runtime/cuda_graph.py), optional: a backend that sets `supports_cuda_graph = True` keeps every
# device buffer its decode kernels read fixed across steps. It may define
#   init_cuda_graph_state(max_bs, buckets, num_q_heads, max_context)  # allocate those buffers before capture
#   init_forward_graph(meta)  # host work before a capture/replay (default: init_forward); meta's tensors
#                             # are the graph runner's static buffers, updated in place between replays


def create_attn_backend(
    name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> BaseAttnBackend:
    """Factory by name; imports triton / flashinfer only when asked for them."""
    if name == "torch":
        from kernels.torch_backend import TorchAttnBackend

        return TorchAttnBackend(k_cache, v_cache, scale)
    if name == "triton":
        from kernels.triton.backend import TritonAttnBackend

        return TritonAttnBackend(k_cache, v_cache, scale)
    if name == "flashinfer":
        from kernels.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(k_cache, v_cache, scale)
    raise ValueError(f"unknown attention backend {name!r} (torch, triton, flashinfer)")
