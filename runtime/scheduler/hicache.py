"""The hierarchical cache: the radix tree's KV pool (tier 1) backed by a file tier on local disk (tier 2).

Data flow (docs/hicache.md):
- Backup. A token path is cut into chunks of `chunk` tokens (a multiple of the page size) named by
  `chunk_keys`. write_through: when a request leaves the pool, every whole chunk of its cached path that the
  tier lacks is copied out of the pool (`KVPoolIO.gather`, a CPU copy on this thread) and queued for the
  tier's writer thread. write_back: the same, for the chunks of each leaf the tree evicts (RadixCache.on_evict,
  while the leaf's path is still in the pool). The disk write is never on the step's path; a full queue drops
  the write (counted).
- Load-back. After the tree's match, `fetch` reads the consecutive tier chunks that continue the match
  (checked entries only) when they cover at least `min_load_tokens`; KVManager then allocates slots, scatters
  the KV into the pool and inserts the tokens into the tree, so the request (and any later one with that
  prefix, in the same step or after) matches them in the pool: a prefix is loaded once.
- A chunk's state: in the pool (a tree node holds its slots), in the tier (an entry file), or both.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Protocol

import torch

from radix_cache import RadixCache, TreeNode
from radix_cache.tier import TierStore, chunk_keys

CHUNK_TOKENS = 64


class KVPoolIO(Protocol):
    """Copies KV between pool slots and CPU tensors, token-major ([n, ...] for n slots)."""

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """A CPU copy of the KV at `slots` (int64 [n]): [n, ...]."""
        ...

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store `kv` ([n, ...], as `gather` returns) at `slots`."""
        ...


def model_identity(path: str | None) -> dict[str, Any]:
    """What names a model file across restarts: its resolved path, size and modification time (every file
    of a model directory). A changed file gives a different identity, so its old entries are never served."""
    if path is None or not os.path.exists(path):
        return {"model": str(path)}
    real = os.path.realpath(path)
    if os.path.isdir(real):
        files = sorted(os.listdir(real))
        return {"model": real, "files": [[f, os.stat(os.path.join(real, f)).st_size,
                                          os.stat(os.path.join(real, f)).st_mtime_ns] for f in files]}
    st = os.stat(real)
    return {"model": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class HiCache:
    def __init__(self, store: TierStore, io: KVPoolIO, page_size: int, write_policy: str,
                 min_load_tokens: int, chunk: int = CHUNK_TOKENS) -> None:
        if write_policy not in ("write_through", "write_back"):
            raise ValueError(f"--hicache-write-policy must be write_through or write_back, got {write_policy!r}")
        self.store = store
        self.io = io
        self.chunk = max(chunk // page_size, 1) * page_size
        self.write_policy = write_policy
        self.min_load_tokens = min_load_tokens
        self.hit_reqs = self.miss_reqs = self.skipped_short = 0

    def attach(self, tree: RadixCache) -> None:
        """write_back: back up what the tree evicts."""
        if self.write_policy == "write_back":
            tree.on_evict = lambda leaf: self._on_evict(tree, leaf)

    # ---- backup -------------------------------------------------------------------------------------------------
    def backup(self, ids: list[int], slots: torch.Tensor, first_pos: int = 0) -> None:
        """Queue every whole chunk of `ids` (KV at `slots`, the tree's slots of the path) ending past
        `first_pos` that the tier lacks."""
        if not self.store.enabled:
            return
        c = self.chunk
        for i, key in enumerate(chunk_keys(ids, c, self.store.digest)):
            if (i + 1) * c <= first_pos or self.store.contains(key):
                continue
            self.store.put(key, i * c, ids[i * c : (i + 1) * c], self.io.gather(slots[i * c : (i + 1) * c]))

    def _on_evict(self, tree: RadixCache, leaf: TreeNode) -> None:
        ids, slots = tree.path(leaf)
        self.backup(ids, slots, first_pos=len(ids) - len(leaf.key))

    # ---- load-back ----------------------------------------------------------------------------------------------
    def fetch(self, ids: list[int], matched: int) -> list[tuple[int, torch.Tensor]]:
        """KV continuing the pool's match of `ids` (`matched` tokens) from the tier: [(position, kv [n, ...])],
        consecutive from `matched`. Empty when the tier holds fewer than `min_load_tokens` of them
        (recomputing is cheaper then) or nothing."""
        c = self.chunk
        if not self.store.enabled or len(ids) - matched < c:
            return []
        keys = chunk_keys(ids, c, self.store.digest)
        first = matched // c
        run = first
        while run < len(keys) and self.store.contains(keys[run]):
            run += 1
        avail = run * c - matched
        if avail <= 0:
            self.miss_reqs += 1
            return []
        if avail < self.min_load_tokens:
            self.skipped_short += 1
            return []
        out: list[tuple[int, torch.Tensor]] = []
        for i in range(first, run):
            kv = self.store.get(keys[i], i * c, ids[i * c : (i + 1) * c])
            if kv is None:  # rejected or gone: recompute from here
                break
            skip = matched - i * c if i == first else 0
            out.append((i * c + skip, kv[skip:]))
        if out:
            self.hit_reqs += 1
        else:
            self.miss_reqs += 1
        return out

    def scatter(self, slots: torch.Tensor, parts: list[tuple[int, torch.Tensor]]) -> None:
        at = 0
        for _, kv in parts:
            self.io.scatter(slots[at : at + kv.shape[0]], kv)
            at += kv.shape[0]

    # ---- control / state ----------------------------------------------------------------------------------------
    def clear(self) -> int:
        return self.store.clear()

    def state(self) -> dict[str, Any]:
        s = self.store.stats
        return {
            "hicache": True,
            "hicache_write_policy": self.write_policy,
            "hicache_dir": self.store.dir,
            "hicache_enabled": self.store.enabled,
            "hicache_hits_total": self.hit_reqs,
            "hicache_misses_total": self.miss_reqs,
            "hicache_skipped_short_total": self.skipped_short,
            "backuped_tokens_total": s.written_tokens,
            "prefetched_tokens_total": s.loaded_tokens,
            "hicache_backup_bytes_total": s.written_bytes,
            "hicache_load_bytes_total": s.loaded_bytes,
            "hicache_load_seconds_total": s.load_s,
            "hicache_load_seconds_per_token": s.load_s / s.loaded_tokens if s.loaded_tokens else 0.0,
            "hicache_rejected_entries_total": s.rejected_entries,
            "hicache_dropped_writes_total": s.dropped_writes,
            "hicache_io_errors_total": s.write_errors + s.read_errors,
            "hicache_evicted_entries_total": s.evicted_entries,
            "hicache_entries": self.store.entries(),
            "hicache_used_bytes": self.store.used_bytes,
            "hicache_total_bytes": self.store.limit_bytes,
        }


def create_hicache(cfg_cache: Any, io: KVPoolIO, identity: dict[str, Any]) -> HiCache | None:
    """The hierarchical cache the flags ask for (None when off). `identity` must name everything that makes
    KV bytes reusable: model file, dtype, KV dtype, page size, layer/head shape."""
    if not cfg_cache.enable_hierarchical_cache or cfg_cache.disable_radix_cache:
        return None
    store = TierStore(cfg_cache.hicache_dir, identity, int(cfg_cache.hicache_size * 2**30))
    atexit.register(store.close)
    return HiCache(store, io, cfg_cache.page_size, cfg_cache.hicache_write_policy, cfg_cache.hicache_min_load_tokens)


def wait_idle(hc: HiCache | None, timeout: float = 30.0) -> None:
    """Block until the tier's queued writes are on disk (tests, benchmarks)."""
    if hc is not None:
        hc.store.flush(timeout)
