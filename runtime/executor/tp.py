"""The tensor-parallel ranks of one launch: rendezvous and the step broadcast (the follower: tp_follower.py).

Rank 0 is the scheduler process's ModelRunner; ranks 1..tp-1 are children of the server (runtime/launch.py
starts them as `tp rank i`, supervised like the scheduler). All join one torch.distributed group (gloo on
CPU, NCCL on CUDA) at `dist_init_addr`. Each rank holds its shard of the weights
(runtime/models/tensor_parallel.py) and a KV pool of its own KV heads, with the same slot count everywhere.
The radix cache, the slot allocator and every scheduling decision live on rank 0 only: per step rank 0
broadcasts the ForwardBatch plus the request-to-token rows it reads, each follower writes those rows into
its own table and runs the same forward, and the all-reduces inside the model join the ranks. Only rank 0
samples. A broadcast of None stops the followers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from runtime.config import Config
from runtime.executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def init_group(cfg: Config, rank: int) -> None:
    """Join the tensor-parallel group (blocks until every rank joined)."""
    import torch.distributed as dist

    par = cfg.parallel
    backend = "nccl" if cfg.model.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{par.dist_init_addr}", rank=rank, world_size=par.tp_size)
    logger.info("tensor parallel rank %d of %d joined (%s at %s)", rank, par.tp_size, backend, par.dist_init_addr)


def threads_per_rank(cfg: Config) -> int:
    """torch threads of one rank: --num-threads (or the machine's cores) split between the ranks."""
    return max(1, (cfg.model.num_threads or os.cpu_count() or 1) // cfg.parallel.tp_size)


def broadcast_step(payload: tuple[ForwardBatch, torch.Tensor] | None) -> Any:
    """Rank 0 sends (fb, rows of req_to_token [B, max seq_len]) or None; the others get it back."""
    import torch.distributed as dist

    box = [payload]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def step_payload(fb: ForwardBatch, table: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
    """What a follower needs for `fb`: the batch (host tensors) and its requests' req_to_token rows."""
    rows = torch.as_tensor(fb.req_pool_indices, dtype=torch.int64).cpu()
    width = max(fb.seq_lens, default=0)
    return fb, table[rows.to(table.device), :width].cpu()
