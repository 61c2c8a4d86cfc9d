"""Unit tests of RadixCache: match/insert/split, locks, LRU eviction, reset, paging, integrity checks."""

from __future__ import annotations

import pytest
import torch

from radix_cache import MatchResult, RadixCache


def t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


class Freed:
    """free_slots callback that records every slot and rejects double frees."""

    def __init__(self) -> None:
        self.slots: list[int] = []

    def __call__(self, slots: torch.Tensor) -> None:
        new = slots.tolist()
        assert not set(new) & set(self.slots), "slot freed twice"
        self.slots.extend(new)


def test_empty_match_returns_root():
    c = RadixCache()
    m = c.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert m.length == 0 and m.last_node is c.root
    assert m.slots.dtype == torch.int64 and m.slots.numel() == 0
    assert c.match_prefix([]).length == 0
    c.check_integrity()


def test_insert_then_match_and_split():
    c = RadixCache()
    assert c.insert([1, 2, 3, 4], t([10, 11, 12, 13])) == 0
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert m.length == 4 and m.slots.tolist() == [10, 11, 12, 13]
    # match ending inside the edge splits it: last_node ends exactly at the match
    m = c.match_prefix([1, 2, 9])
    assert m.length == 2 and m.slots.tolist() == [10, 11]
    assert m.last_node.key == [1, 2] and len(m.last_node.children) == 1
    c.check_integrity()
    assert c.total_size() == 4 and c.evictable_size() == 4
    # diverging insert: already-present length returned, only the new tail is taken
    assert c.insert([1, 2, 7, 8], t([20, 21, 22, 23])) == 2
    assert c.total_size() == 6
    assert c.match_prefix([1, 2, 7, 8]).slots.tolist() == [10, 11, 22, 23]
    assert c.match_prefix([1, 2, 3, 4]).slots.tolist() == [10, 11, 12, 13]
    # full duplicate
    assert c.insert([1, 2, 3], t([30, 31, 32])) == 3
    assert c.total_size() == 6
    c.check_integrity()


def test_insert_splits_inside_edge():
    c = RadixCache()
    c.insert([5, 6, 7, 8], t([0, 1, 2, 3]))
    assert c.insert([5, 6, 9], t([7, 8, 9])) == 2
    assert c.match_prefix([5, 6, 9]).slots.tolist() == [0, 1, 9]
    assert c.match_prefix([5, 6, 7, 8]).slots.tolist() == [0, 1, 2, 3]
    c.check_integrity()
    assert "lock=0" in c.pretty_print()


def test_insert_length_mismatch_raises():
    with pytest.raises(ValueError):
        RadixCache().insert([1, 2], t([1]))


def test_lock_moves_sizes_and_blocks_eviction():
    freed = Freed()
    c = RadixCache(free_slots=freed)
    c.insert([1, 2, 3], t([0, 1, 2]))
    c.insert([1, 2, 4, 5], t([0, 1, 3, 4]))  # shares [1, 2]
    node = c.match_prefix([1, 2, 3]).last_node
    c.lock(node)
    assert c.locked_size() == 3 and c.evictable_size() == 2
    c.lock(node)  # second lock: no size change
    assert c.locked_size() == 3
    c.check_integrity()
    assert c.evict(100) == 2  # only the unlocked [4, 5] branch
    assert sorted(freed.slots) == [3, 4]
    assert c.match_prefix([1, 2, 3]).length == 3
    c.unlock(node)
    assert c.locked_size() == 3
    c.unlock(node)
    assert c.locked_size() == 0 and c.evictable_size() == 3
    with pytest.raises(RuntimeError):
        c.unlock(node)
    assert c.evict(1) == 1  # leaf [3] first, then parent [1, 2] becomes a leaf
    assert c.evict(1) == 2
    assert sorted(freed.slots) == [0, 1, 2, 3, 4] and c.total_size() == 0
    c.check_integrity()


def test_lock_survives_split_of_locked_node():
    c = RadixCache()
    c.insert([1, 2, 3, 4], t([0, 1, 2, 3]))
    node = c.match_prefix([1, 2, 3, 4]).last_node
    c.lock(node)
    c.match_prefix([1, 2])  # splits the locked edge
    c.check_integrity()
    assert c.locked_size() == 4
    c.unlock(node)
    assert c.locked_size() == 0 and c.evictable_size() == 4
    c.check_integrity()


def test_lock_root_is_noop():
    c = RadixCache()
    c.lock(c.root)
    c.unlock(c.root)
    assert c.locked_size() == 0


def test_lru_order():
    freed = Freed()
    c = RadixCache(free_slots=freed)
    c.insert([1, 1], t([0, 1]))
    c.insert([2, 2], t([2, 3]))
    c.insert([3, 3], t([4, 5]))
    c.match_prefix([1, 1])  # [1, 1] most recent; [2, 2] is now the oldest
    assert c.evict(2) == 2
    assert sorted(freed.slots) == [2, 3]
    assert c.evict(2) == 2
    assert sorted(freed.slots) == [2, 3, 4, 5]
    assert c.match_prefix([1, 1]).length == 2
    assert c.evict(0) == 0


def test_evict_reports_less_when_not_enough():
    c = RadixCache(free_slots=Freed())
    c.insert([1, 2], t([0, 1]))
    assert c.evict(10) == 2
    assert c.evict(10) == 0


def test_reset():
    freed = Freed()
    c = RadixCache(free_slots=freed)
    c.insert([1, 2, 3], t([0, 1, 2]))
    c.insert([1, 5], t([0, 3]))
    node = c.match_prefix([1, 5]).last_node
    c.lock(node)
    with pytest.raises(RuntimeError):
        c.reset()
    c.unlock(node)
    c.reset()
    assert sorted(freed.slots) == [0, 1, 2, 3]
    assert c.total_size() == 0 and c.match_prefix([1, 2]).length == 0
    c.insert([4], t([9]))
    c.reset(release=False)
    assert sorted(freed.slots) == [0, 1, 2, 3]
    c.check_integrity()


def test_hit_stats():
    c = RadixCache()
    c.insert([1, 2, 3], t([0, 1, 2]))
    c.match_prefix([1, 2, 9, 9])
    c.match_prefix([1, 2, 3], record=False)
    assert (c.hit_stats.queries, c.hit_stats.query_tokens, c.hit_stats.hit_tokens) == (1, 4, 2)
    assert c.hit_stats.hit_rate == 0.5


def test_all_slots():
    c = RadixCache()
    c.insert([1, 2], t([5, 6]))
    c.insert([1, 3], t([5, 7]))
    assert sorted(c.all_slots().tolist()) == [5, 6, 7]


def test_page_size_two():
    c = RadixCache(page_size=2)
    # only whole pages are inserted; the tail slot stays the caller's
    assert c.insert([1, 2, 3, 4, 5], t([0, 1, 2, 3, 4])) == 0
    assert c.total_size() == 4
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert m.length == 4 and m.slots.tolist() == [0, 1, 2, 3]
    # a match diverging inside a page rounds down to the page boundary
    m = c.match_prefix([1, 2, 3, 9])
    assert m.length == 2 and m.last_node.key == [1, 2]
    assert c.insert([1, 2, 3, 9], t([0, 1, 6, 7])) == 2
    assert c.match_prefix([1, 2, 3, 9]).slots.tolist() == [0, 1, 6, 7]
    assert c.match_prefix([1]).length == 0
    c.check_integrity()
    assert c.evict(1) == 2  # whole pages only


@pytest.mark.parametrize("breakage", ["size", "lock", "value", "parent", "dup"])
def test_check_integrity_detects(breakage):
    c = RadixCache()
    c.insert([1, 2, 3], t([0, 1, 2]))
    c.insert([1, 2, 4], t([0, 1, 3]))
    c.check_integrity()
    upper = c.root.children[1]
    leaf = upper.children[3]
    if breakage == "size":
        c._evictable += 1
    elif breakage == "lock":
        leaf.lock_ref = 1  # child locked but parent not
    elif breakage == "value":
        leaf.value = t([2, 2])
    elif breakage == "parent":
        leaf.parent = c.root
    else:
        upper.children[4].value = t([2])
    with pytest.raises(AssertionError):
        c.check_integrity()
