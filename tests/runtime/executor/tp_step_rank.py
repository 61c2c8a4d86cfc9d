"""One rank of test_tp_step's two-process exchange: `python -m tests.runtime.executor.tp_step_rank RANK PORT`.

In that process every pickle entry point (pickle.dumps/loads/Pickler/Unpickler, torch.distributed's own pickler
references and its *_object collectives) is replaced by a function that raises before the group is joined, so a
step path that pickles fails there. (Importing this module changes nothing: the test imports `steps`.) Rank 0 broadcasts two steps and the stop message; rank 1 prints what it received."""

from __future__ import annotations

import json
import pickle
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _no_pickle(*a, **k):
    raise AssertionError("pickle used on the tensor-parallel step path")


def _forbid_pickle() -> None:
    for mod, names in ((pickle, ("dumps", "loads", "dump", "load", "Pickler", "Unpickler")),
                       (c10d, ("_pickler", "_unpickler", "broadcast_object_list", "all_gather_object",
                               "scatter_object_list", "gather_object")),
                       (dist, ("broadcast_object_list", "all_gather_object", "scatter_object_list",
                               "gather_object"))):
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, _no_pickle)


from runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from runtime.executor.tp import broadcast_step  # noqa: E402


def steps() -> list[tuple[ForwardBatch, torch.Tensor]]:
    a = ForwardBatch.build([[5], [7, 8, 9]], [3, 0], torch.tensor([10, 11, 12, 13]), [2, 0], num_decode=1,
                           logits_indices=[0, 1, 2, 3])
    b = ForwardBatch.build([[1]], [40], torch.tensor([99]), [1], num_decode=1)
    return [(a, torch.arange(8, dtype=torch.int64).reshape(2, 4)), (b, torch.arange(41, dtype=torch.int64)[None])]


def as_json(fb: ForwardBatch, rows: torch.Tensor) -> dict:
    return {"num_decode": fb.num_decode, "input_ids": fb.input_ids.tolist(), "positions": fb.positions.tolist(),
            "out_cache_loc": fb.out_cache_loc.tolist(), "req_pool_indices": fb.req_pool_indices.tolist(),
            "seq_lens": list(fb.seq_lens), "prefix_lens": list(fb.prefix_lens), "extend_lens": list(fb.extend_lens),
            "logits_indices": fb.logits_indices.tolist(), "rows": rows.tolist()}


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    _forbid_pickle()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    got = []
    for payload in [*steps(), None]:
        out = broadcast_step(payload if rank == 0 else None)
        got.append(None if out is None else as_json(*out))
    dist.destroy_process_group()
    if rank == 1:
        print(json.dumps(got))


if __name__ == "__main__":
    main()
