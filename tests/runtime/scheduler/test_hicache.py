"""The hierarchical cache in the scheduler, on the fake runner (its "KV" of a slot is the token id written
there, poisoned to -1 when freed, and the next token depends on every token read back through the table):
eviction then load-back under pool pressure, two requests racing for one evicted prefix, write_back, rejected
entries falling back to recompute, and a hypothesis state machine over the pool, the tree and the tier."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radix_cache.tier import TierStore, chunk_keys
from runtime.config import make_config
from runtime.executor.memory import ReqToTokenTable
from runtime.scheduler import Scheduler
from runtime.scheduler.hicache import HiCache
from tests.runtime.scheduler.harness import FakeRunner, PoisonAllocator, gen, reference

CHUNK = 8


class FakeIO:
    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        kv = self.runner.kv[slots].clone()
        assert bool((kv >= 0).all()), "backed up a freed slot"
        return kv

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        self.runner.kv[slots] = kv


def build(tmp_path, num_slots: int = 128, policy: str = "write_through", min_load: int = CHUNK, **cfg):
    table = ReqToTokenTable(8, 256)
    runner = FakeRunner(table, num_slots, "hash")
    alloc = PoisonAllocator(num_slots, runner.kv)
    store = TierStore(str(tmp_path), {"model": "fake"}, 1 << 30)
    hc = HiCache(store, FakeIO(runner), 1, policy, min_load, chunk=CHUNK)
    config = make_config(max_total_tokens=num_slots, max_running_requests=8, strict_memory_check=True,
                         enable_hierarchical_cache=True, hicache_write_policy=policy, **cfg)
    return Scheduler(runner, alloc, table, config, frozenset(), hicache=hc), runner, hc


def drain(sched: Scheduler) -> dict[str, object]:
    outs: dict[str, list[int]] = {}
    final: dict[str, object] = {}
    for _ in range(2000):
        if not sched.has_work():
            break
        for o in sched.step():
            outs.setdefault(o.rid, []).extend(o.new_ids)
            final[o.rid] = o
        sched.check_memory(strict=True)
        assert sched.kv.hicache is not None
    assert not sched.has_work()
    sched.kv.hicache.store.flush()  # type: ignore[union-attr]
    return {"ids": outs, "final": final}


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(64) for _ in range(n)]


def test_evicted_prefix_is_loaded_back_with_identical_output(tmp_path):
    sched, runner, hc = build(tmp_path)
    a = prompt(1, 50)
    sched.handle(gen("a", a, 6))
    first = drain(sched)
    assert first["ids"]["a"] == reference(a, 6)
    for i in range(4):  # fill the pool with others: a's KV leaves the pool
        sched.handle(gen(f"o{i}", prompt(10 + i, 60), 6))
        drain(sched)
    assert sched.kv.tree is not None and sched.kv.tree.match_prefix(a, record=False).length < 48
    again = a + first["ids"]["a"] + [5, 6, 7]
    sched.handle(gen("a2", again, 6))
    out = drain(sched)
    assert out["ids"]["a2"] == reference(again, 6)
    s = sched.internal_state()
    assert out["final"]["a2"].cached_tokens >= 48 and s["prefetched_tokens_total"] >= 40
    assert s["hicache_hits_total"] == 1 and s["backuped_tokens_total"] > 0


def test_two_requests_racing_for_one_evicted_prefix_load_it_once(tmp_path):
    sched, runner, hc = build(tmp_path)
    doc = prompt(2, 64)
    sched.handle(gen("doc", doc, 1))
    drain(sched)
    for i in range(3):
        sched.handle(gen(f"o{i}", prompt(20 + i, 70), 2))
        drain(sched)
    assert sched.kv.tree is not None and sched.kv.tree.match_prefix(doc, record=False).length == 0
    q1, q2 = doc + [1, 2, 3], doc + [4, 5, 6, 7]
    sched.handle(gen("q1", q1, 5))
    sched.handle(gen("q2", q2, 5))
    out = drain(sched)
    assert out["ids"]["q1"] == reference(q1, 5) and out["ids"]["q2"] == reference(q2, 5)
    s = sched.internal_state()
    assert s["prefetched_tokens_total"] == 64 and s["hicache_hits_total"] == 1  # once, for both
    assert out["final"]["q1"].cached_tokens == 64 and out["final"]["q2"].cached_tokens == 64


def test_write_back_writes_only_what_is_evicted(tmp_path):
    sched, runner, hc = build(tmp_path, policy="write_back")
    a = prompt(3, 40)
    sched.handle(gen("a", a, 4))
    drain(sched)
    assert sched.internal_state()["backuped_tokens_total"] == 0
    for i in range(4):
        sched.handle(gen(f"o{i}", prompt(30 + i, 60), 4))
        drain(sched)
    assert sched.internal_state()["backuped_tokens_total"] >= 40
    sched.handle(gen("a2", a + [9], 4))
    out = drain(sched)
    assert out["ids"]["a2"] == reference(a + [9], 4) and out["final"]["a2"].cached_tokens >= 40


def test_a_corrupt_entry_is_recomputed_and_counted(tmp_path):
    sched, runner, hc = build(tmp_path)
    a = prompt(4, 40)
    sched.handle(gen("a", a, 2))
    drain(sched)
    keys = chunk_keys(a, CHUNK, hc.store.digest)
    path = f"{hc.store.dir}/{keys[2]}.kv"
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x7f")
    sched.kv.tree.reset()  # type: ignore[union-attr]  # an empty pool: only the tier can help
    sched.kv.allocator.reset()
    sched.handle(gen("a2", a + [1], 3))
    out = drain(sched)
    assert out["ids"]["a2"] == reference(a + [1], 3)
    s = sched.internal_state()
    assert s["hicache_rejected_entries_total"] == 1 and out["final"]["a2"].cached_tokens == 16


def test_flush_cache_empties_the_tier_and_says_so(tmp_path):
    sched, runner, hc = build(tmp_path)
    sched.handle(gen("a", prompt(5, 40), 2))
    drain(sched)
    assert hc.store.entries() == 5
    out = sched.flush_cache()
    assert out.success and "tier" in out.message and hc.store.entries() == 0


def test_short_tier_runs_are_recomputed(tmp_path):
    sched, runner, hc = build(tmp_path, min_load=24)
    a = prompt(6, 16)
    sched.handle(gen("a", a, 1))
    drain(sched)
    sched.kv.tree.reset()  # type: ignore[union-attr]
    sched.kv.allocator.reset()
    sched.handle(gen("b", a + [1, 2], 2))
    out = drain(sched)
    assert out["final"]["b"].cached_tokens == 0 and sched.internal_state()["hicache_skipped_short_total"] == 1


class HiCacheMachine(RuleBasedStateMachine):
    """Random conversations over a small pool: every output equals the reference, the slot accounting and the
    tree's invariants hold after every step (drain), and every tier entry holds exactly its path's "KV"
    (the fake's KV of a token is the token id)."""

    policy = "write_through"
    loads = 0  # tier tokens loaded over all examples (the test below checks the machine exercises load-back)

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.sched, self.runner, self.hc = build(self.tmp.name, num_slots=96, policy=self.policy)
        self.history: list[list[int]] = []
        self.n = 0

    @rule(base=st.integers(0, 4), tail=st.lists(st.integers(0, 63), max_size=12), extend=st.booleans(),
          max_new=st.integers(1, 6))
    def request(self, base: int, tail: list[int], extend: bool, max_new: int) -> None:
        ids = (self.history[base % len(self.history)] if extend and self.history else prompt(base, 24)) + tail
        ids = ids[:80]
        self.n += 1
        rid = f"r{self.n}"
        self.sched.handle(gen(rid, ids, max_new))
        out = drain(self.sched)
        assert out["ids"][rid] == reference(ids, max_new)
        self.history.append(ids + out["ids"][rid])

    @rule()
    def restart_tier(self) -> None:
        """Reopen the tier from its directory (the index rebuilt, every entry's header checked)."""
        old = self.hc.store
        old.flush()
        old.close()
        self.hc.store = TierStore(self.tmp.name, {"model": "fake"}, 1 << 30)
        assert self.hc.store.stats.rejected_entries == 0

    @invariant()
    def tier_entries_hold_their_tokens(self) -> None:
        store = self.hc.store
        store.flush()
        for key in list(store._index):
            with open(f"{store.dir}/{key}.kv", "rb") as f:
                header = store._read_header(f, key)
            assert header is not None
            kv = store.get(key, header["start"], header["tokens"])
            assert kv is not None and kv.tolist() == header["tokens"]

    def teardown(self) -> None:
        type(self).loads += self.hc.store.stats.loaded_tokens
        self.hc.store.close()
        self.tmp.cleanup()


class WriteBackMachine(HiCacheMachine):
    policy = "write_back"


_SETTINGS = settings(max_examples=20, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck))
TestHiCacheMachine = HiCacheMachine.TestCase
TestHiCacheMachine.settings = _SETTINGS
TestWriteBackMachine = WriteBackMachine.TestCase
TestWriteBackMachine.settings = _SETTINGS


def test_zz_the_machines_loaded_from_the_tier():
    """Runs after the machines (file order): they must have exercised load-back, not only recompute."""
    assert HiCacheMachine.loads > 0 and WriteBackMachine.loads > 0


def test_flags_metrics_and_server_info_fields(tmp_path):
    from server.cli import build_parser, config_from_args
    from server.metrics import HICACHE_METRICS, Metrics

    ns = build_parser().parse_args(["serve", "--enable-hierarchical-cache", "--hicache-size", "0.5", "--hicache-dir",
                                    str(tmp_path), "--hicache-write-policy", "write_back"])
    c = config_from_args(ns).cache
    assert c.enable_hierarchical_cache and c.hicache_size == 0.5 and c.hicache_write_policy == "write_back"
    sched, runner, hc = build(tmp_path)
    sched.handle(gen("a", prompt(7, 40), 2))
    drain(sched)
    state = sched.internal_state()
    assert state["backuped_tokens_total"] == 40 and state["hicache_entries"] == 5
    text = Metrics().render("sglang", "m", state)
    for name, _, _ in HICACHE_METRICS:
        assert f"sglang:{name}{{" in text, name
    assert 'sglang:backuped_tokens_total{model_name="m"} 40' in text
    assert "hicache" not in Metrics().render("sglang", "m", {"max_total_num_tokens": 10})


def test_settings_it_cannot_honour_are_refused():
    import pytest

    from runtime.config import resolve

    for bad, word in (({"hicache_write_policy": "write_around"}, "write-policy"), ({"hicache_size": 0}, "size"),
                      ({"tp_size": 2}, "tp-size")):
        with pytest.raises(ValueError, match=word):
            resolve(make_config(enable_hierarchical_cache=True, **bad))
