"""The sliding-window KV pool and radix cache on a fake runner (no model): two slot spaces, tombstones, the match
cut, sliding-window locks (runtime/scheduler/swa_cache.py, radix_cache/swa.py).

The fake model keeps each token id in a full pool and in a sliding-window (SWA) pool reached through the
allocator's full -> SWA map; freed SWA slots are poisoned. Every new token of every step checks that the SWA
pool still holds exactly the last W tokens of its request (through the map), then the next token is the harness's
hash of the whole sequence. So a cache hit whose window was freed, a wrong adoption or a premature free raises,
and outputs must equal `reference()`. After every step the scheduler's strict check runs: full and SWA
accounting (free + evictable + locked + request-owned == total) and the tree's invariants.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radix_cache.swa import cut_match
from runtime.config import make_config
from runtime.executor.memory import ReqToTokenTable
from runtime.executor.swa_memory import SWASlotAllocator
from runtime.messages import AbortReq
from runtime.scheduler import Scheduler
from runtime.scheduler.swa_cache import SWAKVManager
from tests.runtime.scheduler.harness import Results, V, drain, gen, next_token, prompt, reference, step

W = 8


class PoisonSWAAllocator(SWASlotAllocator):
    def __init__(self, full_slots: int, swa_slots: int, window: int) -> None:
        super().__init__(full_slots, swa_slots, window, strict=True)
        self.kv_full = torch.full((full_slots,), -1, dtype=torch.int64)
        self.kv_swa = torch.full((swa_slots,), -1, dtype=torch.int64)

    def free_swa(self, slots: torch.Tensor) -> int:
        swa = self.host[slots.to(torch.int64).flatten()]
        self.kv_swa[swa[swa >= 0]] = -1
        return super().free_swa(slots)

    def free(self, slots: torch.Tensor) -> None:
        super().free(slots)
        self.kv_full[slots.to(torch.int64)] = -1


class FakeSWARunner:
    vocab_size = V

    def __init__(self, table: ReqToTokenTable, alloc: PoisonSWAAllocator) -> None:
        self.table, self.alloc = table, alloc
        self.window_reads = 0

    def forward(self, fb):
        a = self.alloc
        loc = fb.out_cache_loc.to(torch.int64)
        swa = a.host[loc]
        assert bool((swa >= 0).all()), "a new token got no SWA slot"
        a.kv_full[loc] = fb.input_ids
        a.kv_swa[swa] = fb.input_ids
        owner = [b for b, e in enumerate(fb.extend_lens) for _ in range(e)]
        logits = torch.zeros(len(fb.logits_indices), V)
        want = set(fb.logits_indices.tolist())
        for idx, b in enumerate(owner):
            pos, row = int(fb.positions[idx]), int(fb.req_pool_indices[b])
            slots = self.table.table[row, : pos + 1].to(torch.int64)
            toks = a.kv_full[slots]
            assert bool((toks >= 0).all()), f"read a freed full slot at position {pos}"
            win = a.host[slots[max(0, pos + 1 - W) :]]
            assert bool((win >= 0).all()), f"position {pos}: its window has a freed SWA slot"
            assert a.kv_swa[win].tolist() == toks[max(0, pos + 1 - W) :].tolist(), f"position {pos}: wrong SWA K/V"
            self.window_reads += 1
            if idx in want:
                logits[sorted(want).index(idx), next_token(toks, "hash")] = 10.0
        return logits


def create(full_slots: int = 256, swa_slots: int = 128, max_running: int = 8, **cfg):
    table = ReqToTokenTable(max_running, 256)
    alloc = PoisonSWAAllocator(full_slots, swa_slots, W)
    runner = FakeSWARunner(table, alloc)
    config = make_config(max_total_tokens=full_slots, max_running_requests=max_running, strict_memory_check=True,
                         **cfg)
    sched = Scheduler(runner, alloc, table, config, frozenset())
    assert isinstance(sched.kv, SWAKVManager)
    return sched, runner


def both_pools_whole(sched) -> None:
    st_ = sched.internal_state()
    assert st_["kv_locked_slots"] == 0 and st_["swa_locked_slots"] == 0
    assert st_["kv_free_slots"] + st_["kv_evictable_slots"] == st_["max_total_num_tokens"]
    assert st_["swa_free_slots"] + st_["swa_evictable_slots"] == st_["swa_total_slots"]


def test_cut_match_keeps_the_window_before_the_end_present():
    p = torch.tensor([True] * 20)
    assert cut_match(p, 4) == 20
    p[17] = False  # inside the last 4: the end moves before it, and 17's own window [13, 17) is present
    assert cut_match(p, 4) == 17
    p[14] = False
    assert cut_match(p, 4) == 14
    p[[3, 9]] = False  # 14's window [10, 14) is present
    assert cut_match(p, 4) == 14
    p[11] = False
    assert cut_match(p, 4) == 9
    assert cut_match(torch.tensor([False, True]), 4) == 0
    assert cut_match(torch.tensor([], dtype=torch.bool), 4) == 0


def test_sliding_memory_per_request_stays_flat_past_the_window():
    sched, _ = create()
    p = prompt(12, 1)
    sched.handle(gen("a", p, 100))
    res, held = Results(), []
    while sched.has_work():
        step(sched, res)
        for r in sched.running:
            held.append(sched.kv.held_swa(r) + sched.internal_state()["swa_locked_slots"])
    assert res.ids("a") == reference(p, 100)
    assert max(held) <= 2 * W + 1, held  # private window (W + 1) + the locked end of its cached prompt (<= W)
    assert max(held[-20:]) <= W + 1  # 112 tokens in, the locked prompt end has left the window sum: flat
    both_pools_whole(sched)


def test_prefix_hits_after_the_window_moved_are_exact_and_cut_back():
    sched, runner = create(full_slots=256, swa_slots=48)
    first = prompt(30, 2)
    sched.handle(gen("a", first, 40))
    res = drain(sched)
    assert res.ids("a") == reference(first, 40)
    # a's decoded tokens left its window one by one: the tree holds them without SWA K/V except the last W
    convo = first + res.ids("a")[:-1]
    present = sched.kv.swa_alloc.present(sched.kv.tree.match_prefix(convo, record=False).slots)
    assert not bool(present[: len(convo) - W].all()) and bool(present[-W:].all())
    second = convo + prompt(6, 3)
    sched.handle(gen("b", second, 10))
    # mid-conversation branch: the match past position 31 has no window there, so it is cut back to 30
    third = first + prompt(3, 4)
    sched.handle(gen("c", third, 10))
    res = drain(sched, res)
    assert res.ids("b") == reference(second, 10) and res.ids("c") == reference(third, 10)
    assert res.final("b").cached_tokens == len(convo)  # the whole conversation hit: its last W are present
    assert res.final("c").cached_tokens == 30  # the prompt's end still has its window (cut, not dropped)
    # under SWA pressure the tree's windows are tombstoned (full K/V kept) and later hits cut back further
    for i in range(4):
        q = prompt(40, 10 + i)
        sched.handle(gen(f"p{i}", q, 4))
        res = drain(sched, res)
        assert res.ids(f"p{i}") == reference(q, 4)
    sched.handle(gen("d", second, 10))
    res = drain(sched, res)
    assert res.ids("d") == reference(second, 10)
    assert res.final("d").cached_tokens < len(second)
    full = sched.kv.tree.match_prefix(second, record=False).length
    assert full >= len(convo), "tombstones keep the full K/V in the tree"
    both_pools_whole(sched)


def test_retraction_and_abort_free_both_pools():
    prompts = {f"r{i}": prompt(20, 20 + i) for i in range(4)}
    sched, _ = create(full_slots=150, swa_slots=60, schedule_conservativeness=0.05)
    for rid, p in prompts.items():
        sched.handle(gen(rid, p, 60))
    sched.handle(gen("x", prompt(30, 9), 80))
    res = Results()
    for _ in range(30):
        step(sched, res)
    sched.handle(AbortReq(rid="x"))
    res = drain(sched, res)
    assert sched.internal_state()["num_retracted_reqs"] > 0
    assert res.final("x").finish_reason.type == "abort"
    for rid, p in prompts.items():
        assert res.ids(rid) == reference(p, 60)
    both_pools_whole(sched)
    assert sched.kv.flush()
    st_ = sched.internal_state()
    assert st_["kv_free_slots"] == 150 and st_["swa_free_slots"] == 60


def test_chunked_prefill_and_disabled_radix_cache_keep_the_window():
    for cfg in ({"chunked_prefill_size": 8}, {"disable_radix_cache": True}):
        sched, _ = create(**cfg)
        ps = {f"q{i}": prompt(25 + 3 * i, 40 + i) for i in range(3)}
        for rid, p in ps.items():
            sched.handle(gen(rid, p, 30))
        res = drain(sched)
        for rid, p in ps.items():
            assert res.ids(rid) == reference(p, 30)
        both_pools_whole(sched)


class SWACacheMachine(RuleBasedStateMachine):
    """Random conversations (new prompts, continuations of earlier ones, branches, aborts) over small pools:
    every output equals the reference, both pools' accounting and the tree's invariants hold after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.sched, self.runner = create(full_slots=160, swa_slots=40, max_running=4, chunked_prefill_size=16)
        self.history: list[list[int]] = []
        self.n = 0

    def _ids(self, base: int, cut: int, tail: list[int], extend: bool) -> list[int]:
        if extend and self.history:
            h = self.history[base % len(self.history)]
            return h[: max(1, len(h) - cut)] + tail
        return prompt(20 + base, base) + tail

    @rule(base=st.integers(0, 4), cut=st.integers(0, 12), tail=st.lists(st.integers(0, V - 1), max_size=8),
          extend=st.booleans(), max_new=st.integers(1, 16), abort_after=st.integers(0, 6))
    def conversation(self, base: int, cut: int, tail: list[int], extend: bool, max_new: int,
                     abort_after: int) -> None:
        ids = self._ids(base, cut, tail, extend)[:90]
        self.n += 1
        rid, other = f"r{self.n}", f"o{self.n}"
        self.sched.handle(gen(rid, ids, max_new))
        side = prompt(10 + base, 100 + self.n)
        self.sched.handle(gen(other, side, 12))
        res = Results()
        for _ in range(abort_after):
            step(self.sched, res)
        if abort_after:
            self.sched.handle(AbortReq(rid=other))
        res = drain(self.sched, res)
        assert res.ids(rid) == reference(ids, max_new)
        got = res.ids(other)
        assert got == reference(side, len(got))
        self.history.append(ids + res.ids(rid))

    @invariant()
    def both_pools_whole(self) -> None:
        both_pools_whole(self.sched)
        self.sched.kv.tree.check_integrity()


TestSWACacheMachine = SWACacheMachine.TestCase
TestSWACacheMachine.settings = settings(max_examples=10, stateful_step_count=8, deadline=None,
                                        suppress_health_check=list(HealthCheck))
