"""Property test: RadixCache against a naive model, driven by a hypothesis RuleBasedStateMachine.

Model: `cached` maps every cached page-aligned token prefix (a tuple) to the KV slots of its last page. A
trie is closed under page-aligned prefixes, so the longest match and the already-present length follow. A
slot pool of POOL slots checks accounting: every slot is either free or held by exactly one cached prefix,
and `free_slots` never receives a slot twice or a slot of a locked path.

RadixModelSWA adds the sliding-window state (radix_cache/swa.py) over a fake second pool (the set of slots
whose sliding-layer K/V is present): sliding-window locks on fully locked paths, tombstones, K/V coming back
to tree slots (`recount`); after every step its counters must equal a full walk (`SWAState.check`) and the
model's own count of present tree slots.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radix_cache import RadixCache
from radix_cache.swa import SWAState

POOL = 64
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=8)


class RadixModel(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.free: set[int] = set(range(POOL))
        self.cache = RadixCache(page_size=self.page_size, free_slots=self._on_free)
        self.cached: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.locks: list[tuple[object, tuple[int, ...]]] = []  # (node, prefix it spells)
        self.freed_now: list[int] = []

    def _on_free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64
        for s in slots.tolist():
            assert s not in self.free, f"slot {s} freed twice"
            self.free.add(s)
            self.freed_now.append(s)

    def _aligned(self, ids: list[int]) -> list[int]:
        return ids[: len(ids) - len(ids) % self.page_size]

    def _model_match(self, ids: list[int]) -> int:
        n = 0
        for i in range(self.page_size, len(self._aligned(ids)) + 1, self.page_size):
            if tuple(ids[:i]) not in self.cached:
                break
            n = i
        return n

    def _locked_prefixes(self) -> set[tuple[int, ...]]:
        return {p[:i] for _, p in self.locks for i in range(self.page_size, len(p) + 1, self.page_size)}

    def _model_slots(self, ids: list[int], n: int) -> list[int]:
        P = self.page_size
        return [s for i in range(P, n + 1, P) for s in self.cached[tuple(ids[:i])]]

    @rule(ids=tokens)
    def insert(self, ids: list[int]) -> None:
        if len(ids) > len(self.free):
            self.cache.evict(len(ids) - len(self.free))
            self._apply_eviction()
        if len(ids) > len(self.free):
            return
        fresh = sorted(self.free)[: len(ids)]
        self.free -= set(fresh)
        expected = self._model_match(ids)
        already = self.cache.insert(ids, torch.tensor(fresh, dtype=torch.int64))
        assert already == expected
        end = len(self._aligned(ids))
        for i in range(already, end, self.page_size):
            self.cached[tuple(ids[: i + self.page_size])] = tuple(fresh[i : i + self.page_size])
        # the caller frees its duplicates and the unaligned tail
        self.free |= set(fresh[:already]) | set(fresh[end:])
        assert self.cache.match_prefix(ids, record=False).slots.tolist() == self._model_slots(ids, end)

    @rule(ids=tokens)
    def match(self, ids: list[int]) -> None:
        m = self.cache.match_prefix(ids)
        n = self._model_match(ids)
        assert m.length == n
        assert m.slots.tolist() == self._model_slots(ids, n)
        depth, node = 0, m.last_node
        while node is not self.cache.root:
            depth += len(node.key)
            node = node.parent
        assert depth == n, "last_node must end exactly at the match"

    @rule(ids=tokens)
    def lock(self, ids: list[int]) -> None:
        m = self.cache.match_prefix(ids)
        self.cache.lock(m.last_node)
        if m.length:
            self.locks.append((m.last_node, tuple(ids[: m.length])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size()
        got = self.cache.evict(n)
        assert got == len(self.freed_now)
        assert got >= n or self.cache.evictable_size() == 0
        assert before - got == self.cache.evictable_size()
        self._apply_eviction()

    def _apply_eviction(self) -> None:
        by_slot = {s: p for p, page in self.cached.items() for s in page}
        locked = self._locked_prefixes()
        gone = {by_slot[s] for s in self.freed_now}
        assert {s for p in gone for s in self.cached[p]} == set(self.freed_now), "a page freed in part"
        assert not gone & locked, "evicted a locked path"
        for p in gone:
            del self.cached[p]
        self.freed_now.clear()
        for p in self.cached:  # still prefix-closed
            assert len(p) == self.page_size or p[: len(p) - self.page_size] in self.cached

    @rule()
    def reset_if_unlocked(self) -> None:
        if self.locks:
            return
        self.cache.reset()
        self._apply_eviction()
        assert not self.cached

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()
        locked = self._locked_prefixes()
        P = self.page_size
        assert self.cache.total_size() == P * len(self.cached)
        assert self.cache.locked_size() == P * len(locked)
        assert self.cache.evictable_size() == P * (len(self.cached) - len(locked))
        held = self.cache.all_slots().tolist()
        assert sorted(held) == sorted(s for page in self.cached.values() for s in page)
        assert len(self.free) + len(held) == POOL and not self.free & set(held)


class RadixModelPaged(RadixModel):
    page_size = 2


class RadixModelSWA(RadixModel):
    def __init__(self) -> None:
        super().__init__()
        self.has_swa: set[int] = set(range(POOL))  # slots whose sliding-layer K/V is present
        self.swa = SWAState(self.cache, 3, self._present, self._free_swa)
        self.swa_locks: list[tuple[object, int, int]] = []  # (node, covered, index of its full lock)

    def _present(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.tensor([s in self.has_swa for s in slots.tolist()], dtype=torch.bool)

    def _free_swa(self, slots: torch.Tensor) -> int:
        gone = self.has_swa & set(slots.tolist())
        self.has_swa -= gone
        return len(gone)

    def _on_free(self, slots: torch.Tensor) -> None:
        super()._on_free(slots)
        self.has_swa |= set(slots.tolist())  # a freed slot comes back with both kinds of K/V

    @precondition(lambda self: len(self.swa_locks) < len(self.locks))
    @rule(i=st.integers(0, 100), span=st.integers(1, 8))
    def swa_lock(self, i: int, span: int) -> None:
        """At most one sliding-window lock per full lock (as the scheduler: swa_lock_ref <= lock_ref)."""
        free = sorted(set(range(len(self.locks))) - {k for _, _, k in self.swa_locks})
        k = free[i % len(free)]
        node = self.locks[k][0]
        self.swa_locks.append((node, self.swa.swa_lock(node, span), k))

    @precondition(lambda self: self.swa_locks)
    @rule(i=st.integers(0, 100))
    def swa_unlock(self, i: int) -> None:
        node, covered, _ = self.swa_locks.pop(i % len(self.swa_locks))
        self.swa.swa_unlock(node, covered)

    @precondition(lambda self: self.locks and not self.swa_locks)  # no full unlock under a sliding-window lock
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        super().unlock(i)

    @rule(n=st.integers(0, 20))
    def tombstone(self, n: int) -> None:
        before = self.swa.sizes()
        freed = self.swa.tombstone(n)
        assert freed >= n or self.swa.sizes()[0] == 0
        assert self.swa.sizes() == (before[0] - freed, before[1])

    @rule(ids=tokens)
    def heal(self, ids: list[int]) -> None:
        m = self.cache.match_prefix(ids)
        self.has_swa |= set(m.slots.tolist())
        self.swa.recount(m.last_node, m.length)

    @invariant()
    def swa_counters(self) -> None:
        self.swa.check()
        held = set(self.cache.all_slots().tolist())
        assert sum(self.swa.sizes()) == len(held & self.has_swa)


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestRadixModel = RadixModel.TestCase
TestRadixModel.settings = SETTINGS
TestRadixModelPaged = RadixModelPaged.TestCase
TestRadixModelPaged.settings = SETTINGS
TestRadixModelSWA = RadixModelSWA.TestCase
TestRadixModelSWA.settings = SETTINGS
