"""KV bookkeeping for a model with sliding-window layers: two slot spaces (runtime/executor/swa_memory.py).

Same ownership rule as KVManager for full slots; on top of it, for sliding-window (SWA) slots:
- every running request keeps the SWA K/V of its last W positions (W: the window). Before each allocation and
  size query, `_slide` frees the SWA slots of every running request's private tokens (positions >= tree_len)
  below cached_len - W, so its sliding-layer memory stays bounded by the window (plus the step's new tokens);
- the tree's tokens may lose their SWA K/V under SWA pressure (tombstones, radix_cache/swa.py), except those a
  running request will still read: a sliding-window lock (next to the full lock) covers exactly the tokens of
  its tree prefix at or past cached_len - W (and, for a step being planned, the tokens it computes). `_slide`
  shrinks a lock to the last W once a step is done and drops it once the window has left the tree prefix;
- a match is cut back to the longest length whose last W positions still have SWA K/V (`cut_match`), so a hit
  is exact: the new tokens attend to exactly the K/V a fresh prefill would have computed;
- where a request's own copy of a tree token still has SWA K/V and the tree's does not, the tree's token
  adopts it (`adopt_swa`), so rewriting the row with the tree's slots keeps the window present.
SWA accounting: swa free + swa evictable + swa locked + request-owned == swa total, where a request owns the
SWA slots of its private positions [tree_len, seq_len) that are still present.
"""

from __future__ import annotations

import torch

from radix_cache.swa import SWAState, cut_match
from radix_cache.tree import TreeNode
from runtime.executor.memory import ReqToTokenTable, SlotAllocator
from runtime.executor.swa_memory import SWASlotAllocator
from runtime.scheduler.cache import KVManager
from runtime.scheduler.core import Req
from runtime.scheduler.hicache import HiCache

_EMPTY = torch.empty(0, dtype=torch.int64)


class SWAKVManager(KVManager):
    def __init__(self, allocator: SWASlotAllocator, table: ReqToTokenTable, use_tree: bool) -> None:
        super().__init__(allocator, table, use_tree)
        self.swa_alloc = allocator
        self.window = allocator.window
        self.swa = (SWAState(self.tree, allocator.window, allocator.present, allocator.free_swa)
                    if self.tree is not None else None)
        # per admitted request (by id): the request; (node, covered) of its sliding-window lock; SWA freed below
        self._live: dict[int, Req] = {}
        self._swa_locks: dict[int, tuple[TreeNode, int]] = {}
        self._slid: dict[int, int] = {}

    # ---- sizes ----------------------------------------------------------------------------------------------------
    def free_size(self) -> int:
        """Free full slots (the full pool's accounting; the SWA pool has its own: `swa_sizes`)."""
        return self.swa_alloc.full_available()

    def available(self) -> int:
        """Tokens obtainable now in both pools: min of (full free + evictable, SWA free + SWA evictable), after
        freeing what no running request can read any more (`_slide`)."""
        self._slide()
        swa = self.swa_alloc.swa_available() + (self.swa.sizes()[0] if self.swa is not None else 0)
        return min(self.free_size() + self.evictable_size(), swa)

    def room(self) -> int:
        """The admission budget counts full slots only: a request's SWA need is bounded by a chunk plus the window
        (earlier chunks' SWA K/V can be tombstoned), and each chunk is cut to `available()`."""
        return self.free_size() + self.evictable_size()

    def swa_sizes(self) -> tuple[int, int, int, int]:
        """(total, free, evictable, locked) of the SWA pool."""
        ev, lk = self.swa.sizes() if self.swa is not None else (0, 0)
        return self.swa_alloc.swa_slots, self.swa_alloc.swa_available(), ev, lk

    def pool_state(self) -> dict[str, int]:
        total, free, ev, lk = self.swa_sizes()
        return {"swa_total_slots": total, "swa_free_slots": free, "swa_evictable_slots": ev,
                "swa_locked_slots": lk, "swa_window": self.window}

    def held_swa(self, req: Req) -> int:
        """SWA slots req's private positions [tree_len, seq_len) still hold."""
        if req.row is None or req.seq_len <= req.tree_len:
            return 0
        return int(self.swa_alloc.present(self.table.read(req.row, req.tree_len, req.seq_len)).sum())

    def check(self, live: list[Req]) -> str | None:
        """SWA accounting (module docstring) and the window invariant of every live request."""
        total, free, ev, lk = self.swa_sizes()
        owned = sum(self.held_swa(r) for r in live)
        if free + ev + lk + owned != total:
            return (f"SWA pool leak: free {free} + evictable {ev} + locked {lk} + request-owned {owned} != total "
                    f"{total} (running {len(live)})")
        if self.swa is not None:
            self.swa.check()
        for r in live:
            lo = max(0, r.cached_len - self.window)
            if r.row is not None and not bool(self.swa_alloc.present(self.table.read(r.row, lo, r.cached_len)).all()):
                return f"request {r.rid}: a position of its last {self.window} has no sliding-window K/V"
        return None

    # ---- matching -----------------------------------------------------------------------------------------------
    def _exact_len(self, ids: list[int]) -> tuple[int, torch.Tensor]:
        """Length of the longest exact cached prefix of ids (the match cut back, see the module docstring)
        and the full slots of the uncut match."""
        assert self.tree is not None
        m = self.tree.match_prefix(ids, record=False)
        return cut_match(self.swa_alloc.present(m.slots), self.window), m.slots

    def peek_match(self, req: Req) -> int:
        if self.tree is None:
            return 0
        ids = req.fill_ids[: req.match_cap()]
        return self._exact_len(ids)[0] if ids else 0

    def admit(self, req: Req) -> bool:
        if not super().admit(req):
            return False
        self._live[id(req)], self._slid[id(req)] = req, 0
        return True

    def _take_match(self, req: Req, row: int, ids: list[int]) -> None:
        """The match cut back to its exact length n (module docstring), locked and written to req's row."""
        assert self.tree is not None
        n, _ = self._exact_len(ids)
        m = self.tree.match_prefix(ids[:n], record=False)  # ends exactly at n (splits the edge there)
        st = self.tree.hit_stats
        st.queries, st.query_tokens, st.hit_tokens = st.queries + 1, st.query_tokens + len(ids), st.hit_tokens + n
        req.cached_len = req.tree_len = m.length
        self._move_lock(req, m.last_node, m.length)
        self.table.write(row, 0, m.slots)

    # ---- allocation ---------------------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """n full slots with an SWA slot each: what running requests no longer read is freed first, then the
        tree's sliding-layer K/V is tombstoned, then leaves are evicted (both pools)."""
        if n <= 0:
            return _EMPTY
        self._slide()
        a = self.swa_alloc
        if self.tree is not None and self.swa is not None:
            if a.swa_available() < n:
                self.swa.tombstone(n - a.swa_available())
            while a.swa_available() < n and self.tree.evict(n - a.swa_available()):
                pass
            if a.full_available() < n:
                self.tree.evict(n - a.full_available())
        return a.alloc(n)

    def _slide(self) -> None:
        """For every admitted request: free the SWA slots of its private positions below cached_len - W, and
        fit its sliding-window lock to the tree tokens it still reads (module docstring)."""
        for r in self._live.values():
            edge = r.cached_len - self.window  # positions below never get read again
            lo = max(r.tree_len, self._slid.get(id(r), 0))
            if edge > lo and r.row is not None:
                self.swa_alloc.free_swa(self.table.read(r.row, lo, edge))
                self._slid[id(r)] = edge
            held = self._swa_locks.get(id(r))
            if held is None or self.swa is None:
                continue
            node, covered = held
            still = r.tree_len - max(0, edge)  # tree tokens at or past the edge
            if still <= 0:
                del self._swa_locks[id(r)]
                self.swa.swa_unlock(node, covered)
            elif covered > self.window and still < covered:
                self.swa.swa_unlock(node, covered)
                self._swa_locks[id(r)] = (node, self.swa.swa_lock(node, still))

    def trim(self, req: Req, keep: int) -> None:
        raise RuntimeError("speculative decoding does not run with the sliding-window KV pool")

    # ---- locks and duplicates -----------------------------------------------------------------------------------
    def _move_lock(self, req: Req, node: TreeNode, length: int) -> None:
        """Full lock on the path, sliding-window lock on its tokens at or past cached_len - W: the last W when
        length == cached_len; a planned step's new tokens too when length > cached_len (cache_planned)."""
        assert self.tree is not None and self.swa is not None
        self.tree.lock(node)
        covered = self.swa.swa_lock(node, length - max(0, min(req.cached_len, length) - self.window))
        self._drop_lock(req)
        req.last_node = node
        self._swa_locks[id(req)] = (node, covered)

    def _drop_lock(self, req: Req) -> None:
        held = self._swa_locks.pop(id(req), None)
        if held is not None and self.swa is not None:
            self.swa.swa_unlock(*held)
        super()._drop_lock(req)

    def _drop_duplicates(self, own: torch.Tensor, canonical: torch.Tensor, node: TreeNode, span: int) -> None:
        if self.swa_alloc.adopt_swa(own, canonical) and self.swa is not None:
            self.swa.recount(node, span)  # tree slots gained sliding-layer K/V
        self.allocator.free(own)

    def release(self, req: Req) -> None:
        super().release(req)
        self._slid.pop(id(req), None)
        self._live.pop(id(req), None)


def create_kv_manager(allocator: SlotAllocator, table: ReqToTokenTable, use_tree: bool,
                      hicache: HiCache | None = None) -> KVManager:
    """The KV manager for the runner's allocator: two slot spaces get SWAKVManager, one gets KVManager."""
    if isinstance(allocator, SWASlotAllocator):
        if hicache is not None:
            raise ValueError("--enable-hierarchical-cache cannot run with the sliding-window KV pool")
        return SWAKVManager(allocator, table, use_tree)
    return KVManager(allocator, table, use_tree, hicache)
