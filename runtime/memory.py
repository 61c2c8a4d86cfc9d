"""KV memory: the paged K/V pool, its slot allocator, and the request-to-token table.

The scheduler allocates slots here for each step's new tokens and writes them into the table row of
each request; the model runner hands the pool tensors to the attention backend, which stores new K/V at
those slots. The radix cache owns slots of finished prefixes; `free + evictable + locked == total`.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V buffers: `k_cache`, `v_cache` are [num_layers, num_slots, num_kv_heads, head_dim]."""

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class SlotAllocator:
    """Hands out KV slot indices. Page size 1 first; with page size P, whole pages are handed out.

    Invariant: every slot in [0, num_slots) is either in the free list or owned by exactly one holder
    (a request's table row or a radix-tree node). Double frees raise in strict mode.
    """

    def __init__(self, num_slots: int, page_size: int = 1, strict: bool = False) -> None:
        if num_slots % page_size:
            raise ValueError("num_slots must be a multiple of page_size")
        self.num_slots = num_slots
        self.page_size = page_size
        self.strict = strict
        self._free = torch.arange(num_slots, dtype=torch.int64)
        self._is_free = torch.ones(num_slots, dtype=torch.bool) if strict else None

    def available(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots (int64, [n]) or None when fewer are free. With page size P, n must be a multiple of P."""
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        if self._is_free is not None:
            self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).flatten()
        if self._is_free is not None:
            if bool(self._is_free[slots].any()) or slots.unique().numel() != slots.numel():
                raise RuntimeError("double free of KV slots")
            self._is_free[slots] = True
        self._free = torch.cat([self._free, slots])

    def reset(self) -> None:
        self._free = torch.arange(self.num_slots, dtype=torch.int64)
        if self._is_free is not None:
            self._is_free.fill_(True)


class ReqToTokenTable:
    """`table[row, pos]` = KV slot of token `pos` of the request holding `row`. int32 [max_running, max_context]."""

    def __init__(self, max_running: int, max_context: int, device: str | torch.device = "cpu") -> None:
        self.table = torch.zeros((max_running, max_context), dtype=torch.int32, device=device)
        self.max_context = max_context
        self._free_rows = list(range(max_running - 1, -1, -1))
        self.size = max_running

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def available(self) -> int:
        return len(self._free_rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(torch.int32)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.table[row, start:end].to(torch.int64)
