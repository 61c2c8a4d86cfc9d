"""A tensor-parallel follower rank (1..tp-1): a child process of the server, supervised like the scheduler,
that runs every step rank 0 broadcasts on its own shard (runtime/executor/tp.py has the protocol)."""

from __future__ import annotations

import torch

from runtime.config import Config
from runtime.executor.model_runner import ModelRunner
from runtime.executor.tp import broadcast_step
from runtime.messages import ModelInfo


class FollowerLoop:
    """Rank i > 0: run each broadcast step on this rank's shard until rank 0 sends None."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.runner = ModelRunner(cfg, progress=False, tp_rank=rank)
        r = self.runner
        self.model = ModelInfo(r.context_len, r.vocab_size, r.pool.num_slots)

    def run(self) -> None:
        while True:
            payload = broadcast_step(None)
            if payload is None:
                return
            fb, rows = payload
            table = self.runner.req_to_token.table
            idx = torch.as_tensor(fb.req_pool_indices, dtype=torch.int64)
            table[idx.to(table.device), : rows.shape[1]] = rows.to(table.device, table.dtype)
            self.runner.forward_local(fb)


def run_tp_rank_process(spec: dict) -> None:
    from runtime.child import start_child

    rank = spec["tp_rank"]
    start_child(spec, f"tp rank {rank}", lambda cfg, ctx, s: FollowerLoop(cfg, rank))
