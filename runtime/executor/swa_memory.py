"""KV memory of a model with sliding-window layers: two slot spaces and the map between them.

Full-attention layers keep the ordinary pool (`full`, [num_full_layers, full_slots + 1, kv_heads, head_dim]):
its slots ("full slots") are what the request-to-token table and the radix tree hold. Sliding-window layers get
their own pool (`swa`, [num_swa_layers, swa_slots + 1, ...]) and allocator ("SWA slots"). Every full slot maps
to the SWA slot that holds the same token's sliding-layer K/V, or to -1 once that K/V was freed (the token left
every window that could read it). The sliding-layer backend translates its windowed metadata through the map
once per step (kernels/sliding_window.py).

Invariants:
- `full_to_swa[full_pad] == swa_pad`; every other entry is -1 or an SWA slot owned through exactly one full
  slot (the map is injective on its non-negative entries).
- A full slot that is free maps to -1; freeing a full slot frees its SWA slot too.
- The last W positions of every running request map to SWA slots (kept by runtime/scheduler/swa_cache.py).
"""

from __future__ import annotations

import torch

from runtime.config import Config
from runtime.executor.memory import SlotAllocator
from runtime.executor.staging import upload


class SWASlotAllocator(SlotAllocator):
    """The full slot space (this SlotAllocator) with the SWA one beside it: `alloc(n)` hands out n full slots, each
    with a fresh SWA slot; `free(full)` frees both; `free_swa(full)` frees only the SWA part (the full KV stays).

    `full_to_swa` is the map on the model's device (what the backend reads); `host` is its CPU mirror (what the
    scheduler writes). On a CPU device they are one tensor; otherwise `flush()` (the model runner calls it before
    each forward) sends the entries written since the last flush.
    """

    def __init__(self, full_slots: int, swa_slots: int, window: int, device: str | torch.device = "cpu",
                 strict: bool = False) -> None:
        """window: the sliding layers' attention window W (what the scheduler keeps per request)."""
        super().__init__(full_slots, 1, strict)
        self.swa = SlotAllocator(swa_slots, 1, strict)
        self.swa_slots, self.window = swa_slots, window
        self.full_to_swa = torch.full((full_slots + 1,), -1, dtype=torch.int64, device=device)
        self.full_to_swa[full_slots] = swa_slots  # pad slot -> pad slot
        self.host = self.full_to_swa if self.full_to_swa.device.type == "cpu" else self.full_to_swa.cpu()
        self._dirty: list[torch.Tensor] = []  # full slots whose map entry changed since the last flush

    # ---- SlotAllocator seam -------------------------------------------------------------------------------------
    def available(self) -> int:
        """Full slots obtainable right now with an SWA slot each."""
        return min(self.full_available(), self.swa.available())

    def full_available(self) -> int:
        return super().available()

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.full_available() or n > self.swa.available():
            return None
        full, swa = super().alloc(n), self.swa.alloc(n)
        assert full is not None and swa is not None, "checked above"
        self._set(full, swa)
        return full

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).flatten()
        self.free_swa(slots)
        super().free(slots)

    def reset(self) -> None:
        super().reset()
        self.swa.reset()
        self.host[: self.num_slots] = -1
        if self.host is not self.full_to_swa:
            self.full_to_swa[: self.num_slots] = -1
            self._dirty = []

    # ---- the SWA side ----------------------------------------------------------------------------------------------
    def free_swa(self, slots: torch.Tensor) -> int:
        """Free the SWA slots of full slots `slots` (those that still have one); return how many were freed."""
        if slots.numel() == 0:
            return 0
        slots = slots.to(torch.int64).flatten()
        swa = self.host[slots]
        have = swa >= 0
        n = int(have.sum())
        if n:
            self.swa.free(swa[have])
            self._set(slots[have], torch.full((n,), -1, dtype=torch.int64))
        return n

    def present(self, slots: torch.Tensor) -> torch.Tensor:
        """bool [n]: which of the full slots `slots` still have their SWA K/V."""
        return self.host[slots.to(torch.int64)] >= 0

    def adopt_swa(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        """Where dst[i] has no SWA slot and src[i] has one, move src[i]'s SWA slot to dst[i] (both hold the same
        token's K/V: a request's duplicate of a tree slot whose sliding-layer K/V had been freed); returns how
        many moved."""
        src, dst = src.to(torch.int64), dst.to(torch.int64)
        move = (self.host[dst] < 0) & (self.host[src] >= 0)
        moved = int(move.sum())
        if moved:
            s, d = src[move], dst[move]
            self._set(d, self.host[s].clone())
            self._set(s, torch.full((s.numel(),), -1, dtype=torch.int64))
        return moved

    def swa_available(self) -> int:
        return self.swa.available()

    def _set(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        self.host[full] = swa
        if self.host is not self.full_to_swa:
            self._dirty.append(full)

    def flush(self) -> None:
        """Send the map entries written since the last flush to the device copy (a no-op on CPU)."""
        if not self._dirty:
            return
        idx = torch.cat(self._dirty)
        self._dirty = []
        i, v = upload([idx, self.host[idx]], self.full_to_swa.device)
        self.full_to_swa[i] = v


def check_hybrid_swa(cfg: Config) -> None:
    """Refuse, in one line each, the features that cannot run over the two slot spaces yet."""
    off = "; pass --disable-hybrid-swa-memory to keep one pool of every layer"
    spec = cfg.speculative.speculative_algorithm
    refused = [
        (cfg.cache.enable_hierarchical_cache, "--enable-hierarchical-cache (its tier stores one pool's layout)"),
        (spec is not None and spec.lower() != "none", "speculative decoding (verify trims rows of one pool)"),
        (cfg.parallel.tp_size > 1, "--tp-size > 1"),
        (cfg.cache.page_size > 1, "--page-size > 1"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{what} cannot run with the sliding-window KV pool of this model{off}")
