"""The attention seam between the model and its kernels.

Data flow per forward: the model runner builds one `AttnMetadata` from the step's ForwardBatch, calls
`backend.init_forward(meta)` once (host-side planning happens there, never per layer), then each attention
layer calls `backend.forward(q, k, v, layer_id)`. The backend first stores the new K/V into the paged pool at
`meta.out_cache_loc`, then attends over each request's whole sequence (cached prefix + new tokens), reading
slots through `req_to_token`.

A step may mix decode and extend rows (a mixed prefill+decode step): rows [0, num_decode) are decode rows,
one new token each (tokens [0, num_decode)); rows [num_decode, B) are extend rows (new prompts, chunk
continuations, jump-forward extends), their tokens following in row order. `forward` sends the decode rows
through `decode` and the extend rows through `extend`; a backend without a split path may treat a decode row
as an extend row of length 1 (exact, only slower), which is what the base class does for mixed steps.

Same-step sharing (runtime/scheduler/prefill.py): an extend row's prefix may include slots that an earlier
extend row of the same step writes (32 questions over a document computed in that step), so a backend stores
every extend row's new K/V before any extend row attends (decode rows never read another row's new slots).

Pool layout: `k_cache`, `v_cache` are `[num_layers, num_slots, num_kv_heads, head_dim]`.
Slot 0.. are real slots; a page of size P holds slots [p*P, (p+1)*P).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnMetadata:
    """Per-step attention inputs (built once per forward by the model runner, immutable).

    B = requests in the batch, T = new tokens in the batch.
    Invariants: seq_lens == prefix_lens + extend_lens; sum(extend_lens) == T; extend_lens[:num_decode] == 1.
    """

    num_decode: int  # rows [0, num_decode) are decode rows; the rest are extend rows
    req_to_token: torch.Tensor  # [max_running, max_context] int32: (row, position) -> slot
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64 tokens per request after this step
    prefix_lens: torch.Tensor  # [B] int64 tokens already in the pool before this step
    extend_lens: torch.Tensor  # [B] int64 new tokens per request (1 for decode rows)
    out_cache_loc: torch.Tensor  # [T] int64 slot of each new token
    seq_lens_cpu: tuple[int, ...]  # host copies, for kernels that plan on the host
    prefix_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        """Every row is a decode row."""
        return self.num_decode == self.batch_size

    @property
    def is_extend(self) -> bool:
        """No row is a decode row."""
        return self.num_decode == 0


class BaseAttnBackend(ABC):
    """What the model calls per attention layer. q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D].

    Invariants: `init_forward(meta)` is called once per step before any layer; after `forward` (or
    `extend`/`decode`) returns, the new k/v are in the pool at `meta.out_cache_loc` for `layer_id` (later
    steps read them from there); K/V slots are only read through `meta.req_to_token`.

    CUDA graphs (runtime/executor/cuda_graph.py): a backend with `supports_cuda_graph = True` keeps every
    device buffer its decode kernels read fixed across steps. It allocates them in `init_cuda_graph_state`
    before capture; before each capture and replay the graph runner calls `init_forward_graph(meta)`, whose
    meta tensors are the runner's static buffers updated in place (only host work may happen there).
    """

    supports_cuda_graph: bool = False
    meta: AttnMetadata  # the current step's metadata, set by `init_forward`

    @abstractmethod
    def init_forward(self, meta: AttnMetadata) -> None:
        """Plan the step (host work, index tensors). Called once per forward, before the first layer."""

    @abstractmethod
    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Store k/v, then attend every row as an extend row (causal over its new tokens, full over its prefix)."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Store k/v, then attend every row as a decode row (one new token over its whole sequence)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """The model's one entry point per layer. Mixed steps go through `extend` unless overridden."""
        if self.meta.is_decode:
            return self.decode(q, k, v, layer_id)
        return self.extend(q, k, v, layer_id)

    def init_cuda_graph_state(self, max_bs: int, buckets: tuple[int, ...], num_q_heads: int,
                              max_context: int) -> None:
        """Allocate the fixed device buffers the captured decode kernels read (graph-capable backends)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_graph(self, meta: AttnMetadata) -> None:
        """Host work before a capture or replay over the graph runner's static buffers."""
        self.init_forward(meta)

