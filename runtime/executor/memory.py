"""KV memory: the paged K/V pool, its slot allocator, and the request-to-token table.

The scheduler allocates slots here for each step's new tokens and writes them into the table row of
each request; the model runner hands the pool tensors to the attention backend, which stores new K/V at
those slots. The radix cache owns slots of finished prefixes; `free + evictable + locked == total`.
"""

from __future__ import annotations

import torch

from runtime.executor.staging import upload


class KVPool:
    """Per-layer K and V buffers: `k_cache`, `v_cache` are [num_layers, num_slots + 1, num_kv_heads, head_dim].

    Slots 0 .. num_slots-1 are handed out by the SlotAllocator. The extra last slot, `pad_slot`, belongs to no
    one: padded rows of a CUDA-graph batch write their K/V there, so padding never touches a real slot.
    """

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.pad_slot = num_slots

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """A CPU copy of the K and V at `slots` (int64 [n]), token-major: [n, 2, num_layers, kv_heads, head_dim]
        (the hierarchical cache's unit of transfer)."""
        idx = slots.to(self.k_cache.device)
        out = torch.stack((self.k_cache[:, idx].transpose(0, 1), self.v_cache[:, idx].transpose(0, 1)), dim=1)
        return out.cpu()

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store `kv` ([n, 2, num_layers, kv_heads, head_dim], as `gather` returns) at `slots`."""
        idx = slots.to(self.k_cache.device)
        kv = kv.to(self.k_cache.device, self.k_cache.dtype)
        self.k_cache[:, idx] = kv[:, 0].transpose(0, 1)
        self.v_cache[:, idx] = kv[:, 1].transpose(0, 1)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def gpu_kv_slots(
    total_bytes: int, free_bytes: int, mem_fraction_static: float, bytes_per_slot: int, page_size: int = 1
) -> int:
    """KV pool size in slots on a GPU, called after the weights are loaded (SGLang's rule).

    Weights plus the KV pool may hold `mem_fraction_static` of the device's total memory; the rest stays free
    for activations, CUDA graphs and the sampler. What is already used (`total - free`: the weights, the CUDA
    context, other processes) counts against that share, so KV bytes = free - total * (1 - fraction).
    Rounded down to whole pages; raises when nothing is left, naming the two knobs that fix it.
    """
    if not 0.0 < mem_fraction_static < 1.0:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {mem_fraction_static}")
    kv_bytes = free_bytes - int(total_bytes * (1.0 - mem_fraction_static))
    slots = max(kv_bytes, 0) // bytes_per_slot // page_size * page_size
    if slots < page_size:
        used, budget = (total_bytes - free_bytes) / 2**30, total_bytes * mem_fraction_static / 2**30
        raise ValueError(
            f"no GPU memory left for the KV pool: {used:.1f} GiB already in use, budget "
            f"{budget:.1f} GiB (--mem-fraction-static {mem_fraction_static}); raise --mem-fraction-static or "
            "set --max-total-tokens"
        )
    return slots


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
    """`table[row, pos]` = KV slot of token `pos` of the request holding `row`. int32 [max_running, max_context].

    `table` lives on the model's device (the attention kernels read it); `host` is its CPU mirror, which the
    scheduler writes and reads. On CUDA, `write` updates the mirror and queues the range; `flush()` (called by
    the model runner before each forward) sends every queued entry in one pinned copy and one scatter, so a
    decode step of B requests costs one transfer instead of B, and `read` never waits for the device.
    Invariant: after `flush()`, table == host on every row in use. On CPU the two are the same tensor.
    """

    def __init__(self, max_running: int, max_context: int, device: str | torch.device = "cpu") -> None:
        self.table = torch.zeros((max_running, max_context), dtype=torch.int32, device=device)
        self.host = self.table if self.table.device.type == "cpu" else torch.zeros_like(self.table, device="cpu")
        # written to host, not yet to table: (row, start, n) ranges and (rows [N], cols [N]) int64 scatters
        self._pending: list[tuple[int, int, int]] = []
        self._pending_cells: list[tuple[torch.Tensor, torch.Tensor]] = []
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
        n = slots.numel()
        self.host[row, start : start + n] = slots.to(torch.int32)
        if self.host is not self.table and n:
            self._pending.append((row, start, n))

    def write_cells(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] for every i, one scatter (a decode step's new token per request)."""
        r = torch.tensor(rows, dtype=torch.int64)
        c = torch.tensor(cols, dtype=torch.int64)
        self.host[r, c] = slots.to(torch.int32)
        if self.host is not self.table and rows:
            self._pending_cells.append((r, c))

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.host[row, start:end].to(torch.int64)

    def flush(self) -> None:
        """Send the queued writes to the device table (a no-op on CPU)."""
        if not self._pending and not self._pending_cells:
            return
        rows = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, _, n in self._pending]
                         + [r for r, _ in self._pending_cells])
        cols = torch.cat([torch.arange(a, a + n, dtype=torch.int64) for _, a, n in self._pending]
                         + [c for _, c in self._pending_cells])
        vals = self.host[rows, cols].to(torch.int64)
        self._pending, self._pending_cells = [], []
        r, c, v = upload([rows, cols, vals], self.table.device)
        self.table[r, c] = v.to(torch.int32)
