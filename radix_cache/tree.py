"""RadixCache: a radix tree over token ids whose values are KV slot indices.

Data flow: the scheduler calls `match_prefix(prompt)` to find the cached prefix of a new request (its KV
slots and the deepest node reached), `lock`s that node while the request runs, and on finish (or after each
prefill chunk, or on retraction) `insert`s the request's tokens with the slots that hold their KV, then
`unlock`s. When the KV pool runs short it calls `evict(n)`, which hands the slots of least-recently-used
unlocked leaves back through the `free_slots` callback (the scheduler's `SlotAllocator.free`).

Invariants (checked by `check_integrity`):
- Every non-root node has a non-empty key (a run of token ids) whose length is a multiple of `page_size`, and
  a value: an int64 tensor [len(key)] of KV slots, the slot of each key token's KV.
- A node is stored in its parent's `children` under `child_key(node.key)`: its first token (page size 1) or
  the tuple of its first page of tokens. Siblings therefore never share a first page.
- The token path root -> node spells a prefix of some inserted sequence; the slots along it are its KV.
- No slot appears twice in the tree; the tree owns every slot it holds until it hands it to `free_slots`.
- `lock_ref(n)` = number of locks taken on n or on any descendant of n (each `lock(x)` adds 1 along the
  path x -> root). Hence `lock_ref(parent) >= sum(lock_ref(children))`, and a locked node's path to the
  root is locked.
- `evictable_size() == sum(len(key))` over unlocked nodes, `locked_size()` over locked nodes (root excluded).
- Eviction only removes unlocked leaves, so a locked path is never freed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)



def _parent(node: TreeNode) -> TreeNode:
    """The parent of an attached node below the root (each has one; the root's walk stops before it)."""
    if node.parent is None:
        raise RuntimeError(f"node {node.id} is not attached below the root")
    return node.parent

class TreeNode:
    """One edge of the radix tree (the run of tokens leading into this node) and their KV slots.

    `key`: token ids of the edge; `value`: int64 slots [len(key)]; `children`: child_key -> TreeNode;
    `lock_ref`: see the module docstring; `last_access`: logical clock of the last match/insert that walked
    through this node (the LRU order of eviction). The root has an empty key and value and is never locked
    or evicted. `swa_lock_ref`: sliding-window locks (radix_cache/swa.py).
    """

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "swa_lock_ref", "last_access", "id")

    _next_id = 0

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, last_access: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.swa_lock_ref = 0  # sliding-window locks (radix_cache/swa.py); always 0 for models without windows
        self.last_access = last_access
        self.id = TreeNode._next_id
        TreeNode._next_id += 1

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """`slots`: int64 [length] KV slots of the matched prefix; `last_node`: the deepest node of the match
    (the root when nothing matched), the node to `lock`; `length`: number of matched tokens."""

    slots: torch.Tensor
    last_node: TreeNode
    length: int


@dataclass
class HitStats:
    """Cumulative `match_prefix` counters (only calls with `record=True`)."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache:
    """Prefix cache of KV slots keyed by token ids. Pure data structure: no pool, no model.

    Ownership: slots passed to `insert` beyond the already-present prefix become the tree's; the tree gives
    them back only through `free_slots` (on `evict` or `reset`). Slots returned by `match_prefix` stay the
    tree's; a caller that uses them must `lock` the returned node until it no longer needs them.
    """

    def __init__(self, page_size: int = 1, free_slots: Callable[[torch.Tensor], None] | None = None) -> None:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        self.page_size = page_size
        self.free_slots = free_slots
        # Called with each leaf `evict` is about to free, while it is still attached (so `path(leaf)` works):
        # the hierarchical cache copies its KV to the second tier there. Must not change the tree.
        self.on_evict: Callable[[TreeNode], None] | None = None
        # Node events for state kept beside the tree (radix_cache/swa.py's counters); none may change the tree.
        # on_attach(leaf): insert created leaf. on_split(upper, lower): _split cut lower's edge, upper is new.
        # on_detach(leaf): evict is about to free leaf (after on_evict). on_reset(): reset dropped every node.
        self.on_attach: Callable[[TreeNode], None] | None = None
        self.on_split: Callable[[TreeNode, TreeNode], None] | None = None
        self.on_detach: Callable[[TreeNode], None] | None = None
        self.on_reset: Callable[[], None] | None = None
        self.hit_stats = HitStats()
        self._clock = 0
        self.root = TreeNode([], _EMPTY, None, 0)
        self._evictable = 0
        self._locked = 0

    # ---- keys -------------------------------------------------------------------------------------------
    def child_key(self, key: list[int], start: int = 0) -> int | tuple[int, ...]:
        """Key of `key[start:]` in its parent's children: the first token, or the first page as a tuple."""
        if self.page_size == 1:
            return key[start]
        return tuple(key[start : start + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _common_len(self, key: list[int], ids: list[int], start: int, end: int) -> int:
        """Length of the common prefix of `key` and `ids[start:end]`, rounded down to whole pages."""
        n = min(len(key), end - start)
        if ids[start : start + n] == key[:n]:
            i = n
        else:
            i = 0
            while i < n and key[i] == ids[start + i]:
                i += 1
        return self._aligned(i)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- match / insert -------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], *, record: bool = True) -> MatchResult:
        """Longest cached prefix of `token_ids` (page-aligned when page_size > 1).

        Splits the last edge when the match ends inside it, so `last_node` always ends exactly at `length`.
        Touches the access time of every node on the path. `record=False` leaves `hit_stats` alone (for
        policy look-ups that are not admissions).
        """
        now = self._tick()
        node, pos, parts = self.root, 0, []
        end = self._aligned(len(token_ids))
        while pos < end:
            child = node.children.get(self.child_key(token_ids, pos))
            if child is None:
                break
            n = self._common_len(child.key, token_ids, pos, end)
            split = n < len(child.key)
            if split:
                child = self._split(child, n)
            parts.append(child.value)
            node, pos = child, pos + n
            if split:
                break
        self._touch_path(node, now)
        if record:
            self.hit_stats.queries += 1
            self.hit_stats.query_tokens += len(token_ids)
            self.hit_stats.hit_tokens += pos
        slots = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else _EMPTY)
        return MatchResult(slots, node, pos)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Insert `token_ids` with their KV `slots` (int64 [len(token_ids)]); return `already`, the length of
        the prefix that was already cached before this call.

        Only the page-aligned part `aligned = len(token_ids) - len(token_ids) % page_size` is inserted.
        Ownership after the call:
        - `slots[already:aligned]` now belong to the tree (the caller must not free them);
        - `slots[:already]` stay the caller's. Where they are the very slots the tree holds (the caller got
          them from `match_prefix`) they must NOT be freed; where the caller computed its own copies of those
          tokens' KV (positions past the prefix it matched), they are duplicates the caller frees;
        - `slots[aligned:]` (the unaligned tail, page_size > 1 only) stay the caller's.
        Touches the access time of the whole path.
        """
        if slots.numel() != len(token_ids):
            raise ValueError(f"insert: {len(token_ids)} tokens but {slots.numel()} slots")
        now = self._tick()
        end = self._aligned(len(token_ids))
        node, pos = self.root, 0
        while pos < end:
            ck = self.child_key(token_ids, pos)
            child = node.children.get(ck)
            if child is None:
                leaf = TreeNode(list(token_ids[pos:end]), slots[pos:end].to(torch.int64).clone(), node, now)
                node.children[ck] = leaf
                self._evictable += end - pos
                if self.on_attach is not None:
                    self.on_attach(leaf)
                node = leaf
                break
            n = self._common_len(child.key, token_ids, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        already = pos
        self._touch_path(node, now)
        return already

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens (0 < n < len, page-aligned); return the new upper node.

        The original node object keeps the lower part (so holders of it keep a valid handle); the new upper
        node inherits its lock count and access time, which keeps sizes and lock invariants unchanged.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.swa_lock_ref = child.swa_lock_ref
        parent.children[self.child_key(child.key)] = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[self.child_key(child.key)] = child
        if self.on_split is not None:
            self.on_split(upper, child)
        return upper

    def _touch_path(self, node: TreeNode | None, now: int) -> None:
        while node is not None:
            node.last_access = now
            node = node.parent

    # ---- locks ------------------------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect the path node -> root from eviction. Locking the root is a no-op."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._locked += len(node.key)
            node.lock_ref += 1
            node = _parent(node)

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises RuntimeError if the path is not locked."""
        walk = node
        while walk is not self.root:
            if walk.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {walk!r}")
            walk = _parent(walk)
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._locked -= len(node.key)
            node = _parent(node)

    # ---- eviction ---------------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until >= num_tokens tokens are freed or nothing is
        evictable; return the number of tokens (slots) freed. A parent left childless becomes a candidate."""
        if num_tokens <= 0:
            return 0
        heap: list[tuple[int, int, TreeNode]] = [
            (n.last_access, n.id, n) for n in self._nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            if self.on_evict is not None:
                self.on_evict(leaf)
            if self.on_detach is not None:
                self.on_detach(leaf)
            parent = _parent(leaf)
            del parent.children[self.child_key(leaf.key)]
            leaf.parent = None
            self._evictable -= len(leaf.key)
            freed += len(leaf.key)
            if self.free_slots is not None:
                self.free_slots(leaf.value)
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def reset(self, *, release: bool = True) -> None:
        """Drop every node. Raises RuntimeError if any node is locked (some request still uses its KV).

        With `release=True` every node's slots go to `free_slots`; pass `release=False` when the caller
        resets its allocator itself (flush_cache), so no slot is freed twice.
        """
        if self._locked:
            raise RuntimeError(f"reset with {self._locked} locked tokens in the radix cache")
        if release and self.free_slots is not None:
            for node in self._nodes():
                self.free_slots(node.value)
        self.root = TreeNode([], _EMPTY, None, 0)
        self._evictable = 0
        self._locked = 0
        if self.on_reset is not None:
            self.on_reset()

    # ---- sizes / inspection -------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def locked_size(self) -> int:
        return self._locked

    def total_size(self) -> int:
        return self._evictable + self._locked

    def _nodes(self) -> list[TreeNode]:
        """All non-root nodes, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def path(self, node: TreeNode) -> tuple[list[int], torch.Tensor]:
        """Token ids and KV slots (int64) of the whole path root -> node (node's edge last)."""
        keys: list[list[int]] = []
        vals: list[torch.Tensor] = []
        while node is not self.root:
            keys.append(node.key)
            vals.append(node.value)
            node = _parent(node)
        ids = [t for k in reversed(keys) for t in k]
        return ids, (torch.cat(vals[::-1]) if vals else _EMPTY)

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns, int64 [total_size()] (for leak checks)."""
        vals = [n.value for n in self._nodes()]
        return torch.cat(vals) if vals else _EMPTY

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring)."""
        root = self.root
        assert root.parent is None and not root.key and root.lock_ref == 0, "root must be empty and unlocked"
        evictable = locked = 0
        seen: list[torch.Tensor] = []
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for ck, child in node.children.items():
                assert child.parent is node, f"{child!r}: parent pointer does not point at {node!r}"
                assert child.key, f"{child!r}: empty key"
                assert len(child.key) % self.page_size == 0, f"{child!r}: key not page-aligned"
                assert ck == self.child_key(child.key), f"{child!r}: stored under {ck!r}"
                v = child.value
                assert v.dtype == torch.int64 and v.dim() == 1, f"{child!r}: value must be 1-D int64"
                assert v.numel() == len(child.key), f"{child!r}: {v.numel()} slots for {len(child.key)} tokens"
                assert child.lock_ref >= 0, f"{child!r}: negative lock_ref"
                child_locks += child.lock_ref
                if child.lock_ref:
                    locked += len(child.key)
                else:
                    evictable += len(child.key)
                seen.append(v)
                stack.append(child)
            if node is not root:
                assert node.lock_ref >= child_locks, f"{node!r}: lock_ref below its children's ({child_locks})"
        assert evictable == self._evictable, f"evictable_size {self._evictable} != counted {evictable}"
        assert locked == self._locked, f"locked_size {self._locked} != counted {locked}"
        if seen:
            allslots = torch.cat(seen)
            assert allslots.unique().numel() == allslots.numel(), "a slot appears twice in the tree"

    def pretty_print(self, max_tokens: int = 12) -> str:
        """Indented dump: one line per node with its tokens, slots, lock count and access time."""

        def short(xs: list[int]) -> str:
            body = ",".join(map(str, xs[:max_tokens]))
            return f"[{body}{',...' if len(xs) > max_tokens else ''}]({len(xs)})"

        lines = [f"RadixCache(page_size={self.page_size}, evictable={self._evictable}, locked={self._locked})"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key[:1]):
                lines.append(
                    f"{'  ' * depth}{short(child.key)} slots={short(child.value.tolist())} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)
