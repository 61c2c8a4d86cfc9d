"""Scheduler with a fake runner (no model, tests/runtime/scheduler/harness.py): what it schedules, and that
outputs never depend on it. Every test compares outputs with `reference()` and checks the slot invariant
(strict) after every step and at the end."""

from __future__ import annotations

import pytest

from runtime.messages import (
    AbortReq,
    FinishAbort,
    FinishLength,
    FinishStop,
    FlushCacheReq,
    GetInternalStateReq,
)
from tests.runtime.scheduler.harness import (
    FakeGrammars,
    OnlyToken,
    Results,
    create_scheduler,
    drain,
    gen,
    prompt,
    reference,
    step,
)


# ---------------------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("disable", [False, True])
def test_outputs_match_reference_and_prefix_hits(disable):
    sched, _ = create_scheduler(disable_radix_cache=disable)
    shared = prompt(40)
    prompts = {"a": shared + prompt(5, 1), "b": prompt(12, 2), "c": shared + prompt(7, 3)}
    for rid, p in prompts.items():
        sched.handle(gen(rid, p, 10))
    res = drain(sched)
    for rid, p in prompts.items():
        assert res.ids(rid) == reference(p, 10)
        assert res.final(rid).finish_reason == FinishLength(length=10)
        assert res.final(rid).prompt_tokens == len(p) and res.final(rid).completion_tokens == 10
    # A later request sharing the prefix hits the tree (prompt + output of "a" are cached).
    follow = prompts["a"] + res.ids("a")[:-1] + prompt(3, 4)
    sched.handle(gen("d", follow, 6))
    res2 = drain(sched)
    assert res2.ids("d") == reference(follow, 6)
    expect = 0 if disable else len(prompts["a"]) + 9
    assert res2.final("d").cached_tokens == expect


def test_lpm_orders_longest_cached_prefix_first():
    order = {}
    for policy in ("lpm", "fcfs"):
        sched, _ = create_scheduler(schedule_policy=policy, chunked_prefill_size=-1, max_prefill_tokens=30)
        base = prompt(24, 9)
        sched.handle(gen("warm", base, 1))
        drain(sched)
        sched.batches.clear()
        sched.handle(gen("x", prompt(25, 10), 2))  # nothing cached
        sched.handle(gen("y", base[:12] + prompt(13, 11), 2))  # 12 cached
        sched.handle(gen("z", base + prompt(1, 12), 2))  # 24 cached
        drain(sched)
        order[policy] = [rid for dec, rids, _, _ in sched.batches if not dec for rid in rids]
    assert order["lpm"] == ["z", "y", "x"]
    assert order["fcfs"] == ["x", "y", "z"]


# ---------------------------------------------------------------------------------------------- chunking
def test_chunked_prefill_enters_the_tree_between_chunks():
    sched, _ = create_scheduler(chunked_prefill_size=32)
    p = prompt(100, 5)
    sched.handle(gen("long", p, 5))
    res = Results()
    step(sched, res)
    assert sched.chunked is not None and sched.kv.tree.match_prefix(p, record=False).length == 32
    assert sched.kv.locked_size() == 32  # the partial prefix is locked by the chunked request
    res = drain(sched, res)
    prefills = [(c, e) for dec, _, c, e in sched.batches if not dec]
    assert prefills == [([0], [32]), ([32], [32]), ([64], [32]), ([96], [4])]
    assert res.ids("long") == reference(p, 5)


def test_chunked_request_shares_its_step_with_short_ones():
    sched, _ = create_scheduler(chunked_prefill_size=32)
    sched.handle(gen("long", prompt(70, 1), 3))
    sched.handle(gen("short", prompt(10, 2), 3))
    res = drain(sched)
    assert res.ids("long") == reference(prompt(70, 1), 3)
    assert res.ids("short") == reference(prompt(10, 2), 3)
    assert all(sum(e) <= 32 for dec, _, _, e in sched.batches if not dec)


# ---------------------------------------------------------------------------------------------- memory pressure
def test_admission_reserves_room_for_running_requests():
    sched, _ = create_scheduler(num_slots=100)
    sched.handle(gen("a", prompt(10, 1), 80))
    res = Results()
    step(sched, res)  # a is prefilled and running
    sched.handle(gen("b", prompt(10, 2), 80))
    for _ in range(5):
        step(sched, res)
        st = sched.internal_state()
        assert st["num_waiting_reqs"] == 1 and st["num_running_reqs"] == 1  # b waits: a's tokens are reserved
    res = drain(sched, res)
    assert sched.internal_state()["num_retracted_reqs"] == 0
    assert res.ids("a") == reference(prompt(10, 1), 80) and res.ids("b") == reference(prompt(10, 2), 80)


@pytest.mark.parametrize("disable", [False, True])
def test_retraction_with_a_tiny_pool_keeps_outputs(disable):
    prompts = {f"r{i}": prompt(20, 20 + i) for i in range(4)}
    sched, _ = create_scheduler(num_slots=150, schedule_conservativeness=0.05, disable_radix_cache=disable)
    for rid, p in prompts.items():
        sched.handle(gen(rid, p, 60))
    res = drain(sched)
    assert sched.internal_state()["num_retracted_reqs"] > 0
    assert any(res.final(r).num_retractions for r in prompts)
    for rid, p in prompts.items():
        assert res.ids(rid) == reference(p, 60)
        assert res.final(rid).finish_reason.type == "length"


def test_request_larger_than_the_pool_is_aborted_not_crashed():
    sched, _ = create_scheduler(num_slots=32)
    sched.handle(gen("big", prompt(40), 4))
    sched.handle(gen("ok", prompt(8), 4))
    res = drain(sched)
    assert res.final("big").finish_reason.type == "abort"
    assert res.ids("ok") == reference(prompt(8), 4)


# ---------------------------------------------------------------------------------------------- abort
def test_abort_in_waiting_queue_by_rid_prefix():
    sched, _ = create_scheduler(max_running=1)
    sched.handle(gen("a", prompt(10, 1), 20))
    for i in range(2):
        sched.handle(gen(f"x_{i}", prompt(10, 2), 20))
    sched.handle(gen("y", prompt(10, 3), 5))
    res = Results()
    step(sched, res)
    sched.handle(AbortReq(rid="x"))
    res = drain(sched, res)
    for rid in ("x_0", "x_1"):
        assert res.final(rid).finish_reason == FinishAbort(message="aborted by client")
        assert res.ids(rid) == []
    assert res.ids("a") == reference(prompt(10, 1), 20) and res.ids("y") == reference(prompt(10, 3), 5)


def test_abort_mid_chunk_frees_and_caches_the_partial_prefix():
    sched, _ = create_scheduler(chunked_prefill_size=16)
    p = prompt(64, 7)
    sched.handle(gen("long", p, 4))
    res = Results()
    step(sched, res)
    step(sched, res)
    assert sched.chunked is not None
    sched.handle(AbortReq(rid="long"))
    assert sched.chunked is None
    res = drain(sched, res)
    assert res.final("long").finish_reason.type == "abort"
    assert sched.kv.tree.match_prefix(p, record=False).length == 32  # computed chunks stay cached


def test_abort_while_decoding_and_abort_all():
    sched, _ = create_scheduler()
    sched.handle(gen("a", prompt(10, 1), 50))
    sched.handle(gen("b", prompt(10, 2), 50))
    sched.handle(gen("c", prompt(10, 3), 4))  # finishes before the abort_all
    res = Results()
    for _ in range(4):
        step(sched, res)
    sched.handle(AbortReq(rid="a"))
    step(sched, res)
    assert res.final("a").finish_reason.type == "abort"
    n_a = len(res.ids("a"))
    assert 0 < n_a < 50 and res.ids("a") == reference(prompt(10, 1), n_a)
    sched.handle(AbortReq(abort_all=True, message="shutdown"))
    res = drain(sched, res)
    assert res.final("b").finish_reason == FinishAbort(message="shutdown")
    assert res.ids("c") == reference(prompt(10, 3), 4)


# ---------------------------------------------------------------------------------------------- sharing
def test_n_copies_share_one_prefill():
    sched, _ = create_scheduler()
    p = prompt(40, 8)
    for i in range(3):
        sched.handle(gen(f"q_{i}", p, 5))
    res = drain(sched)
    prefills = [(rids, c, e) for dec, rids, c, e in sched.batches if not dec]
    # Same step: q_0's planned tokens are in the tree before q_1 and q_2 are matched.
    assert prefills[0] == (["q_0", "q_1", "q_2"], [0, 39, 39], [40, 1, 1])
    for i in range(3):
        assert res.ids(f"q_{i}") == reference(p, 5)
    assert [res.final(f"q_{i}").cached_tokens for i in range(3)] == [0, 39, 39]


def test_in_batch_sharing_of_a_common_document():
    sched, _ = create_scheduler()
    doc = prompt(60, 30)
    qs = {f"q{i}": doc + prompt(6, 40 + i) for i in range(4)}
    for rid, p in qs.items():
        sched.handle(gen(rid, p, 3))
    res = drain(sched)
    assert sum(sum(e) for dec, _, _, e in sched.batches if not dec) == 66 + 3 * 6
    for rid, p in qs.items():
        assert res.ids(rid) == reference(p, 3)
    assert sched.internal_state()["cache_hit_rate"] == pytest.approx(3 * 60 / (4 * 66))


# ---------------------------------------------------------------------------------------------- finishing
def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_tokens_and_eos():
    sched, _ = create_scheduler(mode="inc", eos={7}, decode_fn=letters)
    sched.handle(gen("str", [40], 20, stop=["zzz", "rst"]))  # outputs 41.. -> "pqrst"
    sched.handle(gen("tok", [0], 20, stop_token_ids=[5]))
    sched.handle(gen("eos", [2], 20))
    sched.handle(gen("ign", [2], 8, ignore_eos=True))
    sched.handle(gen("min", [2], 20, min_new_tokens=10))
    res = drain(sched)
    assert res.final("str").finish_reason == FinishStop(matched="rst")
    assert res.final("str").stop_trim == "rst" and letters(res.ids("str")).endswith("rst")
    assert res.ids("str") == [41, 42, 43, 44, 45]
    assert res.final("tok").finish_reason == FinishStop(matched=5) and res.ids("tok") == [1, 2, 3, 4, 5]
    assert res.final("eos").finish_reason == FinishStop(matched=7) and res.ids("eos") == [3, 4, 5, 6, 7]
    assert res.final("ign").finish_reason.type == "length" and res.ids("ign") == list(range(3, 11))
    assert len(res.ids("min")) >= 10 and 7 not in res.ids("min")[:9]


def test_max_new_tokens_zero_and_prompt_logprobs_cap_the_prefix():
    sched, _ = create_scheduler(mode="inc")
    p = [0, 1, 2, 3, 9, 10, 11]
    sched.handle(gen("warm", p, 2))
    drain(sched)
    sched.handle(gen("lp", p, 0, return_logprob=True, logprob_start_len=0, top_logprobs_num=2))
    sched.handle(gen("lp3", p, 0, return_logprob=True, logprob_start_len=3))
    res = drain(sched)
    out = res.final("lp")
    assert out.finish_reason == FinishLength(length=0) and out.new_ids == []
    assert out.cached_tokens == 0  # capped so every prompt position is computed
    assert [t for _, t in out.input_logprobs] == p and out.input_logprobs[0][0] is None
    lps = [lp for lp, _ in out.input_logprobs[1:]]
    assert [lp > -0.1 for lp in lps] == [True, True, True, False, True, True]
    assert out.input_top_logprobs[0] is None and out.input_top_logprobs[1][0][1] == 1
    out3 = res.final("lp3")
    assert out3.cached_tokens == 2 and [t for _, t in out3.input_logprobs] == p[3:]


def test_prompt_logprobs_across_chunks_and_output_logprobs():
    sched, _ = create_scheduler(mode="inc", chunked_prefill_size=8)
    p = list(range(30))
    sched.handle(gen("c", p, 4, return_logprob=True, logprob_start_len=0, top_logprobs_num=3))
    res = drain(sched)
    outs = res["c"]
    inp = [o.input_logprobs for o in outs if o.input_logprobs is not None]
    assert len(inp) == 1 and [t for _, t in inp[0]] == p and all(lp > -0.1 for lp, _ in inp[0][1:])
    out_lp = [x for o in outs for x in o.output_logprobs]
    assert [t for _, t in out_lp] == [30, 31, 32, 33] and all(lp > -0.1 for lp, _ in out_lp)
    tops = [x for o in outs for x in o.output_top_logprobs]
    assert len(tops) == 4 and all(len(t) == 3 and t[0][1] == tok for t, tok in zip(tops, [30, 31, 32, 33], strict=True))


# ---------------------------------------------------------------------------------------------- control and seams
def test_flush_cache_and_internal_state():
    sched, _ = create_scheduler()
    sched.handle(gen("a", prompt(20), 30))
    step(sched, Results())
    assert not sched.handle(FlushCacheReq()).success
    drain(sched)
    assert sched.kv.evictable_size() > 0
    assert sched.handle(FlushCacheReq()).success
    st = sched.handle(GetInternalStateReq()).state
    for key in ("num_running_reqs", "num_waiting_reqs", "max_total_num_tokens", "kv_free_slots",
                "kv_evictable_slots", "kv_locked_slots", "cache_hit_rate", "num_retracted_reqs"):
        assert key in st
    assert st["kv_free_slots"] == st["max_total_num_tokens"] == 512 and st["kv_evictable_slots"] == 0






def test_grammar_queue_and_mask():
    backend = FakeGrammars()
    sched, _ = create_scheduler(grammar_backend=backend)
    sched.handle(gen("g", prompt(5), 10, regex="x+"))
    sched.handle(gen("bad", prompt(5), 10, regex="("))
    sched.handle(gen("plain", prompt(6), 3))
    res = Results()
    step(sched, res)
    assert sched.internal_state()["num_grammar_queue_reqs"] == 2
    backend.futures[0].set_result(OnlyToken(9, 3))
    backend.futures[1].set_exception(ValueError("bad regex"))
    res = drain(sched, res)
    # Grammar ended without EOS: the last token is content, not a matched stop token (so it is not trimmed).
    assert res.ids("g") == [9, 9, 9] and res.final("g").finish_reason == FinishStop(matched=None)
    assert res.final("bad").finish_reason.type == "abort" and "bad regex" in res.final("bad").finish_reason.message
    assert res.ids("plain") == reference(prompt(6), 3)
