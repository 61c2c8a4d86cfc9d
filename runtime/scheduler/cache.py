"""KV bookkeeping of requests: table rows, pool slots and the radix tree, in one place.

The scheduler's collaborators never touch the allocator, the table or the tree directly; they call this
manager, which keeps the ownership rule: every slot is free, owned by the tree (evictable or locked), or
owned by exactly one request (positions [tree_len, cached_len) of its row plus this step's new slots).
With the radix cache disabled `tree` is None: nothing is shared, and a request frees all its slots.
With a hierarchical cache (`hicache`), `admit` continues the tree's match with KV loaded from the file tier,
and `release` (write_through) or eviction (write_back) backs the tree's KV up to it (runtime/scheduler/hicache.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radix_cache import RadixCache, TreeNode
from runtime.executor.memory import ReqToTokenTable, SlotAllocator
from runtime.scheduler.core import Req
from runtime.scheduler.hicache import HiCache


class KVManager:
    def __init__(self, allocator: SlotAllocator, table: ReqToTokenTable, use_tree: bool,
                 hicache: HiCache | None = None) -> None:
        self.allocator = allocator
        self.table = table
        self.page_size = allocator.page_size
        self.tree: RadixCache | None = (
            RadixCache(page_size=allocator.page_size, free_slots=allocator.free) if use_tree else None
        )
        self.hicache = hicache if self.tree is not None else None
        if self.hicache is not None and self.tree is not None:
            self.hicache.attach(self.tree)
        # Called with each request that leaves the pool (`release`): other pools keyed by the request (the
        # speculative draft model's KV) free theirs.
        self.on_release: list[Callable[[Req], None]] = []

    # ---- sizes ------------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.allocator.num_slots

    def free_size(self) -> int:
        return self.allocator.available()

    def evictable_size(self) -> int:
        return self.tree.evictable_size() if self.tree else 0

    def locked_size(self) -> int:
        return self.tree.locked_size() if self.tree else 0

    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.free_size() + self.evictable_size()

    def room(self) -> int:
        """Slots the admission budget counts (a whole request's extend): `available()` for one pool."""
        return self.available()

    # ---- matching -----------------------------------------------------------------------------------------------
    def peek_match(self, req: Req) -> int:
        """Cached-prefix length of `req` without locking or counting it (for the policy)."""
        if self.tree is None:
            return 0
        ids = req.fill_ids[: req.match_cap()]
        return self.tree.match_prefix(ids, record=False).length if ids else 0

    def admit(self, req: Req) -> bool:
        """Give `req` a table row holding its cached prefix (locked in the tree). False when no row is free."""
        row = self.table.alloc_row()
        if row is None:
            return False
        req.row = row
        req.cached_len = req.tree_len = 0
        req.last_node = None
        ids = req.fill_ids[: req.match_cap()]
        if self.tree is not None and ids:
            self._take_match(req, row, ids)
        return True

    def _take_match(self, req: Req, row: int, ids: list[int]) -> None:
        """Lock the longest cached prefix of ids (req's first tokens) in the tree, count the query, and write its
        slots into req's table row."""
        assert self.tree is not None
        m = self.tree.match_prefix(ids)
        self.tree.lock(m.last_node)
        req.last_node = m.last_node
        req.cached_len = req.tree_len = m.length
        self.table.write(row, 0, m.slots)
        if self.hicache is not None:
            self._load_back(req, ids, m.length)

    def _load_back(self, req: Req, ids: list[int], matched: int) -> None:
        """Continue req's locked match with KV from the tier: fresh slots (evicting if needed; the match is
        locked), the KV scattered into them, the tokens inserted into the tree and req's lock moved to the new
        last node. Nothing changes when the tier has nothing worth loading or the pool has no room."""
        assert self.tree is not None and self.hicache is not None
        parts = self.hicache.fetch(ids, matched)
        n = sum(kv.shape[0] for _, kv in parts)
        slots = self.alloc(n) if n else None
        if slots is None:
            return
        self.hicache.scatter(slots, parts)
        end = matched + n
        have = self.table.read(req.row_index, 0, matched)
        already = self.tree.insert(ids[:end], torch.cat([have, slots]))
        if already > matched:  # cannot happen while the match is locked; keep the slot ownership rule anyway
            self.allocator.free(slots[: already - matched])
        m = self.tree.match_prefix(ids[:end], record=False)
        self.table.write(req.row_index, 0, m.slots)
        req.cached_len, req.tree_len = m.length, m.length
        self._move_lock(req, m.last_node, m.length)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n fresh slots, evicting unlocked cache leaves if needed; None when even that is not enough."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        short = n - self.allocator.available()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    def extend(self, req: Req, n: int) -> torch.Tensor | None:
        """Allocate n slots for req's next n tokens and write them into its row (positions cached_len..)."""
        slots = self.alloc(n)
        if slots is not None:
            self.table.write(req.row_index, req.cached_len, slots)
            req.extend_len = n
        return slots

    def extend_one_each(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot for the next token of every request in `reqs` (decode rows): one allocation and one table
        scatter for the whole batch. Returns the slots [len(reqs)] int64 in `reqs` order, or None (nothing
        changed) when even eviction cannot free enough."""
        slots = self.alloc(len(reqs))
        if slots is not None and reqs:
            self.table.write_cells([r.row_index for r in reqs], [r.cached_len for r in reqs], slots)
            for r in reqs:
                r.extend_len = 1
        return slots

    def trim(self, req: Req, keep: int) -> None:
        """A speculative verify row is done: positions [keep, seq_len) of req's row (rejected drafts, and the
        accepted tail whose KV the next step recomputes) go back to the allocator at once; they were never
        in the tree (tree_len <= cached_len <= keep). Then cached_len = keep, extend_len = 0."""
        end = req.seq_len
        if not req.tree_len <= keep <= end:
            raise RuntimeError(f"trim of {req!r} to {keep} outside [tree_len, seq_len {end}]")
        self.allocator.free(self.table.read(req.row_index, keep, end))
        req.cached_len, req.extend_len = keep, 0

    # ---- caching progress -------------------------------------------------------------------------------------
    def cache_unfinished(self, req: Req) -> None:
        """Insert req's computed tokens into the tree (after a prefill chunk), move its lock to the new last
        node and rewrite its row with the tree's canonical slots; duplicate slots are freed at once."""
        if self.tree is None:
            return
        ids = req.fill_ids[: req.cached_len]
        slots = self.table.read(req.row_index, 0, req.cached_len)
        already = self.tree.insert(ids, slots)
        m = self.tree.match_prefix(ids, record=False)
        if already > req.tree_len:
            self._drop_duplicates(slots[req.tree_len : already], m.slots[req.tree_len : already], m.last_node,
                                  m.length - req.tree_len)
        self.table.write(req.row_index, 0, m.slots)
        self._move_lock(req, m.last_node, m.length)
        req.tree_len = m.length

    def cache_planned(self, req: Req) -> None:
        """Insert req's tokens [0, seq_len) into the tree while planning the step that computes them, so later
        requests of the same step match and extend from them (the forward stores every row's new K/V before
        any row attends). The new slots become tree-owned and locked by req (tree_len may pass cached_len until
        the forward). Skipped when the tree already holds some of the new tokens (a capped match, e.g. n > 1
        copies of one prompt): those slots must not be freed before the forward writes them, so the processor's
        `cache_unfinished` dedupes them after it instead."""
        if self.tree is None:
            return
        ids = req.fill_ids[: req.seq_len]
        if self.tree.match_prefix(ids, record=False).length > req.tree_len:
            return
        self.tree.insert(ids, self.table.read(req.row_index, 0, req.seq_len))
        m = self.tree.match_prefix(ids, record=False)
        self._move_lock(req, m.last_node, m.length)
        req.tree_len = m.length

    def release(self, req: Req) -> None:
        """Req leaves the pool (finished, aborted or retracted): its computed KV goes into the tree (so a next
        chat turn or its own readmission hits), its lock is dropped and its row freed."""
        for hook in self.on_release:
            hook(req)
        if req.row is None:
            return
        slots = self.table.read(req.row_index, 0, req.cached_len)
        if self.tree is None:
            self.allocator.free(slots)
        else:
            ids = req.fill_ids[: req.cached_len]
            already = self.tree.insert(ids, slots)
            if already > req.tree_len:
                self.allocator.free(slots[req.tree_len : already])
            aligned = req.cached_len - req.cached_len % self.page_size
            if aligned < req.cached_len:  # unaligned tail (page_size > 1) stays ours: free it
                self.allocator.free(slots[aligned:])
            self._drop_lock(req)
            if self.hicache is not None and self.hicache.write_policy == "write_through" and aligned:
                self.hicache.backup(ids[:aligned], self.tree.match_prefix(ids[:aligned], record=False).slots)
        self.table.free_row(req.row)
        req.row, req.last_node = None, None
        req.cached_len = req.tree_len = req.extend_len = 0

    # ---- lock hooks (the sliding-window manager adds its own locks: runtime/scheduler/swa_cache.py) -----------
    def _move_lock(self, req: Req, node: TreeNode, length: int) -> None:
        """Lock `node` (its path spells req's first `length` tokens) for req, then drop req's previous lock (in
        that order, so a shared path stays locked)."""
        assert self.tree is not None
        self.tree.lock(node)
        self._drop_lock(req)
        req.last_node = node

    def _drop_lock(self, req: Req) -> None:
        if self.tree is not None and req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node = None

    def _drop_duplicates(self, own: torch.Tensor, canonical: torch.Tensor, node: TreeNode, span: int) -> None:
        """req computed its own copies (`own`) of tokens the tree already holds (`canonical`, among the last
        `span` tokens of the path root -> node): free them."""
        self.allocator.free(own)

    def pool_state(self) -> dict[str, int]:
        """Extra pool counters for /get_server_info and /metrics (none for one pool)."""
        return {}

    def check(self, live: list[Req]) -> str | None:
        """A broken extra pool invariant, named; None when all hold (one pool: nothing beyond the scheduler's)."""
        return None

    def flush(self) -> bool:
        """Empty the tree (only when no request holds a lock)."""
        if self.tree is None:
            return True
        if self.tree.locked_size():
            return False
        self.tree.reset()
        if self.hicache is not None:
            self.hicache.clear()
        return True
