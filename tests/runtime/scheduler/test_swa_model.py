"""The window-aware KV pool and radix cache on a real forward: tiny random Gemma 3 (sliding, full, sliding
layers; window 5), float32, the scheduler driven in-process.

The reference is the same checkpoint with one pool of every layer (--disable-hybrid-swa-memory) and the radix
cache off. With the window pool the sliding-window pool is a quarter of the full one, so the tree's
sliding-layer K/V is tombstoned while the conversation goes on; every greedy token must still be the
reference's, including turns that hit the cache after the window has moved past the earlier prompt.
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import make_config
from runtime.executor.model_runner import create_model_runner
from runtime.executor.swa_memory import SWASlotAllocator
from tests.runtime.models.tiny import GEMMA3_WINDOW, tiny_checkpoint
from tests.runtime.scheduler.driver import Driver, generate

FULL_SLOTS = 256


def _runner(path: str, **cache):
    return create_model_runner(make_config(model_path=path, dtype="float32", kv_cache_dtype="float32",
                                           max_total_tokens=FULL_SLOTS, max_running_requests=4,
                                           attention_backend="torch", disable_compile=True, **cache),
                               progress=False)


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("gemma3_swa"), "gemma3")
    return _runner(path, swa_full_tokens_ratio=0.25), _runner(path, disable_hybrid_swa_memory=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hits_after_the_window_moved_match_no_cache(runners):
    swa, ref = runners
    assert isinstance(swa.allocator, SWASlotAllocator) and not isinstance(ref.allocator, SWASlotAllocator)
    assert swa.swa_pool is not None and swa.swa_pool.k_cache.shape[0] == 2  # the two sliding layers
    assert swa.pool.k_cache.shape[0] == 1 and swa.allocator.swa_slots == FULL_SLOTS // 4
    first = _prompt(20, 1)
    one, _ = generate(ref, None, {"a": first}, max_new=8, disable_radix_cache=True)
    turn2 = first + one["a"] + _prompt(6, 2)  # the next turn of the conversation: 26 tokens past the window
    branch = first[:14] + _prompt(5, 3)  # a branch from inside the first prompt
    others = {f"o{i}": _prompt(40, 10 + i) for i in range(2)}  # fill the sliding pool: tombstones
    prompts = {"a": first, "turn2": turn2, "branch": branch, **others, "again": turn2, "again2": turn2}
    want, _ = generate(ref, None, prompts, max_new=8, disable_radix_cache=True)
    d = Driver(swa, None)
    try:
        for wave in (["a"], ["turn2", "branch"], list(others), ["again"], ["again2"]):
            for rid in wave:
                d.submit(rid, prompts[rid], 8, ignore_eos=True)
            d.run()
            st = d.sched.internal_state()
            assert st["swa_free_slots"] + st["swa_evictable_slots"] == st["swa_total_slots"]
        got = {rid: d.ids(rid) for rid in prompts}
        assert got == want
        hits = {rid: d.final(rid).cached_tokens for rid in prompts}
        w = GEMMA3_WINDOW
        # turn 2 hits the whole first turn (its last W tokens still have sliding-layer K/V)
        assert hits["turn2"] == len(first) + 7
        assert 0 < hits["branch"] <= 14
        # the others' prompts tombstoned the conversation's sliding-layer K/V (the tree keeps its full K/V), so
        # "again" is cut back to a length whose window is present (here: none); its recomputed K/V then
        # refills the tree's tombstones, and "again2" hits the whole prompt
        assert hits["again"] < len(turn2) - 1 - w
        assert hits["again2"] == len(turn2) - 1
        assert d.sched.kv.tree.match_prefix(turn2, record=False).length == len(turn2)
    finally:
        d.close()


def test_sliding_pool_use_per_request_stays_flat_past_the_window(runners):
    swa, _ = runners
    d = Driver(swa, None, disable_radix_cache=True)
    used = []
    try:
        d.submit("long", _prompt(8, 7), 30, ignore_eos=True)
        total = d.sched.internal_state()["swa_total_slots"]
        while d.sched.has_work():
            d.step()
            used.append(total - d.sched.internal_state()["swa_free_slots"])
        d.run()
        assert d.sched.internal_state()["swa_free_slots"] == total
    finally:
        d.close()
    # 38 positions computed; the sliding pool holds the window plus the token of the step
    assert max(used) <= GEMMA3_WINDOW + 8, used  # the 8-token prompt before decoding trims it
    assert max(used[10:]) <= GEMMA3_WINDOW + 1, used


@pytest.mark.parametrize("flag", [{"enable_hierarchical_cache": True}, {"page_size": 4},
                                  {"speculative_algorithm": "ngram"}])
def test_unsupported_combinations_are_refused_in_one_line(runners, flag):
    path = runners[0].model_path
    with pytest.raises(ValueError, match="sliding-window KV pool.*--disable-hybrid-swa-memory") as e:
        _runner(path, **flag)
    assert "\n" not in str(e.value)
    assert not isinstance(_runner(path, disable_hybrid_swa_memory=True, **flag).allocator, SWASlotAllocator)
