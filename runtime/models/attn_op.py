"""Attention as an opaque custom op, so a torch.compile'd forward never traces into a backend.

`radixgen_rt::attention(q, k, v, layer_id, backend_id)` looks the backend up in a process-wide registry by
index and calls its `forward(q, k, v, layer_id)` (which also stores k/v into the pool, a side effect on
state the graph never reads). Any `BaseAttnBackend` plugs in: register it once, then compile a forward whose
`attend` is `opaque_attend(backend_id)`. The fake impl states the contract inductor relies on: the output
is a fresh contiguous tensor shaped and typed like q (every backend allocates its output; `.contiguous()` keeps
the layout).
Graph order is safe without declaring the pool mutation: layer i+1's attention depends on layer i's output.
"""

from __future__ import annotations

import torch

from kernels.api import BaseAttnBackend

_BACKENDS: dict[int, BaseAttnBackend] = {}
PINNED_BASE = 1000  # indices from here on are chosen by the caller (graphs compiled in another process)


def register_backend(backend: BaseAttnBackend, at: int | None = None) -> int:
    """The backend's index for `attention`: its first index if registered before, else the next free one below
    PINNED_BASE. `at` binds it at that index instead (a compiled package that names index `at` then calls it)."""
    if at is not None:
        _BACKENDS[at] = backend
        return at
    for i, b in _BACKENDS.items():
        if b is backend and i < PINNED_BASE:
            return i
    i = 1 + max((k for k in _BACKENDS if k < PINNED_BASE), default=-1)
    _BACKENDS[i] = backend
    return i


# Defined with torch.library.Library rather than @torch.library.custom_op: the latter checks its output's
# aliasing on every call, 10.8 vs 3.6 us per call here (30 calls per decode step).
_LIB = torch.library.Library("radixgen_rt", "DEF")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, int layer_id, int backend_id) -> Tensor")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, backend_id: int) -> torch.Tensor:
    """q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D] contiguous, a fresh tensor (the backend's init_forward ran
    this step)."""
    return _BACKENDS[backend_id].forward(q, k, v, layer_id).contiguous()


_LIB.impl("attention", attention, "CompositeExplicitAutograd")


@torch.library.register_fake("radixgen_rt::attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, backend_id: int) -> torch.Tensor:
    return q.new_empty(q.shape)


def opaque_attend(backend_id: int):
    """An `attend(q, k, v, layer_id)` for LlamaForCausalLM.forward_tokens that goes through the custom op."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return torch.ops.radixgen_rt.attention(q, k, v, layer_id, backend_id)

    return attend
