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

Counters: each attached node's count of tokens with sliding-layer K/V (`_present`), the sums over nodes
outside / under a sliding-window lock (`sizes()`), and the unlocked nodes with a count > 0 (the candidates of
`tombstone`) are kept up to date by the tree's node events (attach, split, detach, reset), the lock flips and
tombstones here, and `recount` after the caller moves sliding-layer K/V onto tree slots. Each update costs the
length of the nodes it touches; no call walks the tree (except `check`, which compares against a full walk).

Invariants (`check`): swa_lock_ref <= lock_ref on every node (a sliding-window lock comes with a full lock),
so a node under a sliding-window lock is never evicted; only its unlocked part may lose sliding-layer K/V. The
counters equal a full walk's.
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
    `present` and `free_swa` (full slots -> bool mask; full slots -> number of sliding-layer slots freed). Owns the
    tree's node-event hooks (on_attach, on_split, on_detach, on_reset)."""

    def __init__(self, tree: RadixCache, window: int, present: Callable[[torch.Tensor], torch.Tensor],
                 free_swa: Callable[[torch.Tensor], int]) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        if tree.page_size != 1:
            raise ValueError("sliding-window state needs a tree of page size 1 (locks split nodes anywhere)")
        self.tree, self.window = tree, window
        self.present, self.free_swa = present, free_swa
        self._present: dict[int, int] = {}  # node.id -> its tokens with sliding-layer K/V (attached nodes)
        self._evictable = self._locked = 0  # sums of _present outside / under a sliding-window lock
        self._candidates: dict[int, TreeNode] = {}  # unlocked nodes with _present > 0
        for node in tree._nodes():  # a tree that already holds nodes (none in the scheduler's use)
            self._attach(node)
        tree.on_attach, tree.on_split, tree.on_detach, tree.on_reset = (self._attach, self._split, self._detach,
                                                                        self._reset)

    # ---- counters -----------------------------------------------------------------------------------------------
    def _count(self, node: TreeNode) -> int:
        return int(self.present(node.value).sum()) if node.value.numel() else 0

    def _set(self, node: TreeNode, n: int) -> None:
        """node's present count becomes n (node attached, lock state unchanged): the sums move by the change."""
        delta = n - self._present.get(node.id, 0)
        if node.swa_lock_ref:
            self._locked += delta
        else:
            self._evictable += delta
        self._store(node, n)

    def _store(self, node: TreeNode, n: int) -> None:
        self._present[node.id] = n
        if n and not node.swa_lock_ref:
            self._candidates[node.id] = node
        else:
            self._candidates.pop(node.id, None)

    def _attach(self, node: TreeNode) -> None:
        self._set(node, self._count(node))

    def _split(self, upper: TreeNode, lower: TreeNode) -> None:
        """lower's tokens are now in two nodes with the same lock state: the count divides, the sums stay."""
        up = self._count(upper)
        self._store(lower, self._present.get(lower.id, 0) - up)
        self._store(upper, up)

    def _detach(self, node: TreeNode) -> None:
        self._set(node, 0)
        del self._present[node.id]

    def _reset(self) -> None:
        self._present.clear()
        self._candidates.clear()
        self._evictable = self._locked = 0

    def _flip(self, node: TreeNode, locked: bool) -> None:
        """node's swa_lock_ref just went 0 -> 1 (locked) or 1 -> 0: its count moves to the other sum."""
        n = self._present.get(node.id, 0)
        if locked:
            self._evictable, self._locked = self._evictable - n, self._locked + n
            self._candidates.pop(node.id, None)
        else:
            self._evictable, self._locked = self._evictable + n, self._locked - n
            if n:
                self._candidates[node.id] = node

    def recount(self, node: TreeNode, span: int) -> None:
        """The caller changed which of the last `span` tokens of the path root -> node have sliding-layer K/V
        (e.g. moved a request's copy onto a tree slot): recount the nodes holding them."""
        covered = 0
        while node is not self.tree.root and covered < span:
            self._set(node, self._count(node))
            covered += len(node.key)
            node = _up(node)

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
            if node.swa_lock_ref == 1:
                self._flip(node, True)
            covered += len(node.key)
            node = _up(node)
        return covered

    def swa_unlock(self, node: TreeNode, covered: int) -> None:
        """Undo the `swa_lock(node, span)` that returned `covered`."""
        while covered > 0:
            if node is self.tree.root or node.swa_lock_ref <= 0:
                raise RuntimeError(f"sliding-window unlock of an unlocked node {node!r}")
            node.swa_lock_ref -= 1
            if node.swa_lock_ref == 0:
                self._flip(node, False)
            covered -= len(node.key)
            node = _up(node)
        if covered < 0:
            raise RuntimeError("sliding-window unlock does not end at a node boundary")

    # ---- pressure -----------------------------------------------------------------------------------------------
    def tombstone(self, n: int) -> int:
        """Free the sliding-layer K/V of unlocked nodes, least recently used first, until >= n slots came back
        or none is left; return the number freed. Nodes stay in the tree with their full K/V. Looks only at the
        nodes that have some to free (`_candidates`)."""
        if n <= 0 or not self._candidates:
            return 0
        heap = [(x.last_access, x.id, x) for x in self._candidates.values()]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            freed += self.free_swa(node.value)
            self._set(node, 0)
        return freed

    # ---- sizes ----------------------------------------------------------------------------------------------------
    def sizes(self) -> tuple[int, int]:
        """(evictable, locked): tree tokens whose sliding-layer K/V is present, outside / under a sliding lock."""
        return self._evictable, self._locked

    def walk_sizes(self) -> tuple[int, int]:
        """`sizes()` recomputed from every node (for `check`)."""
        ev = lk = 0
        for node in self.tree._nodes():
            n = self._count(node)
            if node.swa_lock_ref:
                lk += n
            else:
                ev += n
        return ev, lk

    def check(self) -> None:
        """Raise AssertionError naming the first broken sliding-window invariant or counter."""
        nodes = self.tree._nodes()
        for node in nodes:
            assert 0 <= node.swa_lock_ref <= node.lock_ref, (
                f"{node!r}: swa_lock_ref {node.swa_lock_ref} outside [0, lock_ref]")
            n = self._count(node)
            assert self._present.get(node.id) == n, f"{node!r}: present count {self._present.get(node.id)} != {n}"
            assert (node.id in self._candidates) == bool(n and not node.swa_lock_ref), f"{node!r}: candidate set"
        assert len(self._present) == len(nodes), f"{len(self._present)} counted nodes, {len(nodes)} attached"
        assert self.sizes() == self.walk_sizes(), f"counters {self.sizes()} != full walk {self.walk_sizes()}"
