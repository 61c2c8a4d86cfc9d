"""Sliding-window state over a RadixCache: which cached tokens still have their sliding-layer K/V.

A model with sliding-window layers keeps two kinds of KV per token: full-attention K/V (the slot the tree
holds as `node.value`) and sliding-layer K/V in a second pool, reached through a map owned by the caller.
`present(slots)` says which tokens still have the second kind; `free_swa(slots)` frees it (the full K/V stays).

- Tombstone: `tombstone(n)` frees the sliding-layer K/V of whole nodes in least-recently-used order, skipping
  nodes under a sliding-window lock, until n slots came back. The node keeps its full K/V, so a later prefix
  that reaches past it still finds it; only the window before a match end must be present (next point).
- Exact hits: a query at position p of a sliding layer reads positions (p - W, p]. A cached prefix of length m
  can serve a request only if positions [m - W, m) all have sliding-layer K/V (their keys are what the first
  new token attends to, and nothing before them is ever read again). `cut_match(present, W)` is the longest
  such m (m = 0 is always valid).
- Sliding-window lock: a request that uses a prefix holds the full lock (`RadixCache.lock`) on its whole path
  and a sliding-window lock on the last tokens it will still read (its last W, plus the tokens a planned step
  computes): `swa_lock(node, span)` splits the node where the span starts, adds 1 to `swa_lock_ref` of the
  nodes holding the span and returns its token count; `swa_unlock(node, covered)` walks the same tokens again.
  Later splits keep this exact: both halves inherit the count, and a split never moves the path's end or the
  span's start (a node boundary).

Invariants (`check`): swa_lock_ref <= lock_ref on every node (a sliding-window lock comes with a full lock),
so a node under a sliding-window lock is never evicted; only its unlocked part may lose sliding-layer K/V.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from radix_cache.tree import RadixCache, TreeNode


def _up(node: TreeNode) -> TreeNode:
    assert node.parent is not None, "an attached non-root node has a parent"
    return node.parent


def cut_match(present: torch.Tensor, window: int) -> int:
    """Longest m <= len(present) whose positions [max(0, m - window), m) are all present (bool [L])."""
    m = int(present.numel())
    for j in reversed((~present).nonzero().flatten().tolist()):
        if j >= m - window:
            m = j  # j is missing and inside m's window: no end in (j, m] works
        else:
            break
    return m


class SWAState:
    """The sliding-window side of `tree` (module docstring). Pure bookkeeping: the pool is reached only through
    `present` and `free_swa` (full slots -> bool mask; full slots -> number of sliding-layer slots freed)."""

    def __init__(self, tree: RadixCache, window: int, present: Callable[[torch.Tensor], torch.Tensor],
                 free_swa: Callable[[torch.Tensor], int]) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        if tree.page_size != 1:
            raise ValueError("sliding-window state needs a tree of page size 1 (locks split nodes anywhere)")
        self.tree, self.window = tree, window
        self.present, self.free_swa = present, free_swa

    # ---- locks ------------------------------------------------------------------------------------------------
    def swa_lock(self, node: TreeNode, span: int) -> int:
        """Sliding-window lock on the last `span` tokens of the path root -> node (all of it when shorter);
        returns the tokens covered (pass it to `swa_unlock`). The node holding the span's first token is split
        there, so the lock covers exactly those tokens. The caller holds a full lock on node."""
        covered = 0
        while node is not self.tree.root and covered < span:
            need = span - covered
            if len(node.key) > need:
                self.tree._split(node, len(node.key) - need)  # node keeps its last `need` tokens
            node.swa_lock_ref += 1
            covered += len(node.key)
            node = _up(node)
        return covered

    def swa_unlock(self, node: TreeNode, covered: int) -> None:
        """Undo the `swa_lock(node, span)` that returned `covered`."""
        while covered > 0:
            if node is self.tree.root or node.swa_lock_ref <= 0:
                raise RuntimeError(f"sliding-window unlock of an unlocked node {node!r}")
            node.swa_lock_ref -= 1
            covered -= len(node.key)
            node = _up(node)
        if covered < 0:
            raise RuntimeError("sliding-window unlock does not end at a node boundary")

    # ---- pressure -----------------------------------------------------------------------------------------------
    def tombstone(self, n: int) -> int:
        """Free the sliding-layer K/V of unlocked nodes, least recently used first, until >= n slots came back
        or none is left; return the number freed. Nodes stay in the tree with their full K/V."""
        if n <= 0:
            return 0
        heap = [(x.last_access, x.id, x) for x in self.tree._nodes() if x.swa_lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            freed += self.free_swa(node.value)
        return freed

    # ---- sizes ----------------------------------------------------------------------------------------------------
    def sizes(self) -> tuple[int, int]:
        """(evictable, locked): tree tokens whose sliding-layer K/V is present, outside / under a sliding lock."""
        free: list[torch.Tensor] = []
        locked: list[torch.Tensor] = []
        for node in self.tree._nodes():
            (locked if node.swa_lock_ref else free).append(node.value)
        return self._count(free), self._count(locked)

    def _count(self, values: list[torch.Tensor]) -> int:
        return int(self.present(torch.cat(values)).sum()) if values else 0

    def check(self) -> None:
        """Raise AssertionError naming the first broken sliding-window invariant."""
        for node in self.tree._nodes():
            assert 0 <= node.swa_lock_ref <= node.lock_ref, (
                f"{node!r}: swa_lock_ref {node.swa_lock_ref} outside [0, lock_ref]")
