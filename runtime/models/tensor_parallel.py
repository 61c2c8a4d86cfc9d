"""Tensor parallelism (Megatron-style) of the Llama family over torch.distributed: which rows and columns of
each weight a rank keeps, and the all-reduce that joins the partial sums.

Per layer, rank r of `tp` keeps:
- q/k/v projections (column-parallel): the rows of its heads, q heads [r*Hq/tp, (r+1)*Hq/tp) and k/v heads
  [r*Hkv/tp, (r+1)*Hkv/tp) (so each query head keeps its own KV head: heads are grouped in order), their
  biases (Qwen2) alike; q/k norms (Qwen3, per head_dim) replicated;
- o projection (row-parallel): the columns of its q heads -> a partial [T, H] sum, all-reduced;
- gate/up (column-parallel): rows [r*I/tp, (r+1)*I/tp) of each; down (row-parallel): those columns ->
  a partial sum, all-reduced.
The embedding, the final norm and the lm_head are replicated (every rank computes the full logits; no
vocab-parallel gather), and so are the layer norms. A rank's attention and KV pool see only its heads: the
model is built from `local_arch` (Hq/tp, Hkv/tp, I/tp), the KV pool per rank is 1/tp of the whole.

Split rule: tp must divide the query heads, the KV heads and the intermediate size; there is no uneven
split and no KV-head replication. SmolLM2-135M (9 query heads, 3 KV heads, I = 1536) therefore runs at tp 1
or 3, and `check` refuses tp 2 naming that constraint. Quantized weights are refused (a Q4 block of 32
inputs would have to be split along columns): use --quantization none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kernels import quant
from runtime.models.arch import ModelArch

Reduce = Callable[[torch.Tensor], torch.Tensor]


def check(arch: ModelArch, tp: int) -> None:
    """Raise ValueError naming the constraint when `arch` cannot be split over `tp` ranks."""
    if tp < 1:
        raise ValueError(f"--tp-size must be at least 1, got {tp}")
    for what, n in (("attention heads", arch.num_heads), ("key/value heads", arch.num_kv_heads),
                    ("intermediate size", arch.intermediate_size)):
        if n % tp:
            ok = [d for d in range(1, arch.num_kv_heads + 1) if arch.num_kv_heads % d == 0
                  and arch.num_heads % d == 0 and arch.intermediate_size % d == 0]
            raise ValueError(f"--tp-size {tp} must divide the model's {what} ({n}): heads "
                             f"{arch.num_heads}, key/value heads {arch.num_kv_heads}, intermediate size "
                             f"{arch.intermediate_size}; this model splits over tp in {ok}")


def local_arch(arch: ModelArch, tp: int) -> ModelArch:
    """The shape one rank's model is built with (its heads and MLP columns only)."""
    check(arch, tp)
    return dataclasses.replace(arch, num_heads=arch.num_heads // tp, num_kv_heads=arch.num_kv_heads // tp,
                               intermediate_size=arch.intermediate_size // tp)


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[rank * n:(rank + 1) * n].contiguous()


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[1] // tp
    return t[:, rank * n:(rank + 1) * n].contiguous()


def shard_weights(weights: dict[str, torch.Tensor | quant.QTensor], arch: ModelArch, rank: int,
                  tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights ({hf_name: tensor}, the loader's names) out of the full ones."""
    check(arch, tp)
    if any(isinstance(w, quant.QTensor) for w in weights.values()):
        raise ValueError("--tp-size > 1 needs dense weights: pass --quantization none")
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        assert isinstance(w, torch.Tensor)
        kind = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else ""
        if kind in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # weight [out, in] or bias [out]
            out[name] = _rows(w, rank, tp)
        elif kind in ("o_proj", "down_proj"):
            out[name] = _cols(w, rank, tp)
        else:  # norms, embedding, lm_head: replicated
            out[name] = w
    return out


def all_reduce_sum(group: object | None = None) -> Reduce:
    """The row-parallel join: the sum over ranks of each rank's partial [T, H] output, in place."""
    import torch.distributed as dist

    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    return reduce
