"""The tensor-parallel ranks of one launch: rendezvous and the step broadcast (the follower: tp_follower.py).

Rank 0 is the scheduler process's ModelRunner; ranks 1..tp-1 are children of the server (runtime/launch.py
starts them as `tp rank i`, supervised like the scheduler). All join one torch.distributed group (gloo on
CPU, NCCL on CUDA) at `dist_init_addr`. Each rank holds its shard of the weights
(runtime/models/tensor_parallel.py) and a KV pool of its own KV heads, with the same slot count everywhere.
The radix cache, the slot allocator and every scheduling decision live on rank 0 only: per step rank 0
broadcasts the ForwardBatch plus the request-to-token rows it reads, each follower writes those rows into
its own table and runs the same forward, and the all-reduces inside the model join the ranks. Only rank 0
samples. A broadcast of None stops the followers.

Wire of one step, no pickle (the group may span machines, `--nnodes`): three broadcasts from rank 0, the
length of the header, the header (a msgspec `StepHeader`, msgpack bytes as a uint8 tensor: flags and the
per-request length tuples) and one int64 tensor holding, in order, input_ids [T], positions [T],
out_cache_loc [T], req_pool_indices [B], logits_indices [K] and the req_to_token rows [B, W]. Every size is in
the header, so a follower allocates the tensor before it arrives.
"""

from __future__ import annotations

import logging
import os

import msgspec
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


class StepHeader(msgspec.Struct, frozen=True):
    """A step's shape (the part of a ForwardBatch that is not a tensor); `stop`: no step, followers exit."""

    stop: bool = False
    num_decode: int = 0
    seq_lens: tuple[int, ...] = ()
    prefix_lens: tuple[int, ...] = ()
    extend_lens: tuple[int, ...] = ()
    num_logits: int = 0
    row_width: int = 0


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(StepHeader)
STOP = StepHeader(stop=True)


def pack_step(fb: ForwardBatch, rows: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """(msgpack header, one int64 CPU tensor) for `fb` and its requests' req_to_token rows [B, W]."""
    head = StepHeader(num_decode=fb.num_decode, seq_lens=tuple(fb.seq_lens), prefix_lens=tuple(fb.prefix_lens),
                      extend_lens=tuple(fb.extend_lens), num_logits=int(fb.logits_indices.numel()),
                      row_width=int(rows.shape[1]))
    parts = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.logits_indices, rows]
    data = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts])
    return _ENC.encode(head), data


def data_len(head: StepHeader) -> int:
    t, b = sum(head.extend_lens), len(head.seq_lens)
    return 3 * t + b + head.num_logits + b * head.row_width


def unpack_step(header: bytes, data: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor] | None:
    """The inverse of `pack_step` (None for the stop message)."""
    head = _DEC.decode(header)
    if head.stop:
        return None
    t, b = sum(head.extend_lens), len(head.seq_lens)
    ids, pos, loc, pool, logits, rows = data.cpu().split([t, t, t, b, head.num_logits, b * head.row_width])
    fb = ForwardBatch(num_decode=head.num_decode, input_ids=ids, positions=pos, out_cache_loc=loc,
                      req_pool_indices=pool, seq_lens=head.seq_lens, prefix_lens=head.prefix_lens,
                      extend_lens=head.extend_lens, logits_indices=logits)
    return fb, rows.reshape(b, head.row_width)


def broadcast_step(payload: tuple[ForwardBatch, torch.Tensor] | None) -> tuple[ForwardBatch, torch.Tensor] | None:
    """Rank 0 sends (fb, rows of req_to_token [B, W]) or None (stop); every rank gets the step back."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if dist.get_rank() == 0:
        header, data = (_ENC.encode(STOP), torch.zeros(0, dtype=torch.int64)) if payload is None else (
            pack_step(*payload))
        size = torch.tensor([len(header)], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        buf = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=0)
    header = bytes(buf.cpu().numpy())
    head = _DEC.decode(header)
    if head.stop:
        return None
    if dist.get_rank() != 0:
        data = torch.empty(data_len(head), dtype=torch.int64, device=dev)
    else:
        data = data.to(dev)
    dist.broadcast(data, src=0)
    return unpack_step(header, data)


def step_payload(fb: ForwardBatch, table: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
    """What a follower needs for `fb`: the batch (host tensors) and its requests' req_to_token rows."""
    rows = torch.as_tensor(fb.req_pool_indices, dtype=torch.int64).cpu()
    width = max(fb.seq_lens, default=0)
    return fb, table[rows.to(table.device), :width].cpu()
