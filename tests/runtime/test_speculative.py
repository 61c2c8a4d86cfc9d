"""Speculative decoding (n-gram proposer) in the scheduler, with the fake runner of test_scheduler.py.

The fake runner's next token is a function of the tokens read through the request's table row, so a draft
slot left in the row, a freed slot read back or a wrong position changes (or breaks) the output. Every test
compares with `reference()` and checks the strict slot invariant after every step and at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.messages import AbortReq
from runtime.speculative import accept_greedy, propose_ngram
from tests.runtime.test_scheduler import Results, V, drain, gen, make, prompt, reference, step

SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}


def test_ngram_proposer_most_recent_longest_match():
    t = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6], dtype=np.int64)
    assert propose_ngram(t, 3, 1, 3) == [7, 2, 3]  # "5 6" last seen at 6..7, followed by 7 2 3
    assert propose_ngram(t, 2, 3, 3) == []  # "3 5 6" never seen before
    assert propose_ngram(np.array([4, 4, 4], dtype=np.int64), 4, 1, 2) == [4]
    assert propose_ngram(np.array([1], dtype=np.int64), 4, 1, 2) == []
    assert accept_greedy([3, 4, 9], [3, 4]) == [3, 4, 9]
    assert accept_greedy([3, 5, 9], [3, 4]) == [3, 5]
    assert accept_greedy([2, 5, 9], [3, 4]) == [2]


@pytest.mark.parametrize("mode", ["inc", "hash"])
def test_outputs_equal_reference_with_mixed_spec_and_plain_requests(mode):
    sched, _ = make(num_slots=1024, mode=mode, chunked_prefill_size=16, **SPEC)
    ps = {f"r{i}": prompt(20 + 7 * i, seed=i) + list(range(V)) for i in range(4)}
    res = Results()
    for rid, p in ps.items():
        sched.handle(gen(rid, p, 24, disable_speculation=rid == "r3"))
    drain(sched, res)
    for rid, p in ps.items():
        assert res.ids(rid) == reference(p, 24, mode), rid
        assert res.final(rid).completion_tokens == 24
    st = sched.internal_state()
    assert st["spec_verify_ct"] > 0 and st["spec_draft_tokens"] >= st["spec_accepted_tokens"]
    assert res.final("r3").spec_verify_ct == 0  # opted out
    if mode == "inc":  # the prompt holds 0..63, so every continuation of an increasing run is proposed right
        assert st["spec_accept_rate"] > 0.8 and st["spec_accept_length"] > 3.0
        assert res.final("r0").spec_verify_ct <= 8


def test_stop_token_and_max_new_tokens_cut_exactly_inside_a_verify_step():
    sched, _ = make(mode="inc", **SPEC)
    p = list(range(V)) + [10]
    res = Results()
    sched.handle(gen("eos", p, 30, stop_token_ids=[17]))
    sched.handle(gen("len", p, 6))
    drain(sched, res)
    assert res.ids("eos") == list(range(11, 18))  # stops at 17, which the drafts never propose
    assert res.final("eos").finish_reason == {"type": "stop", "matched": 17}
    assert res.ids("len") == list(range(11, 17))
    assert res.final("len").finish_reason["type"] == "length"


def test_streamed_outputs_arrive_in_order():
    sched, _ = make(mode="inc", **SPEC)
    p = list(range(V)) + [3]
    sched.handle(gen("s", p, 20))
    res = drain(sched)
    chunks = [o.new_ids for o in res["s"]]
    assert [t for c in chunks for t in c] == reference(p, 20, "inc")
    assert max(len(c) for c in chunks) > 1  # several tokens per step: they came from verify steps


def test_abort_after_a_verify_step_and_retraction_leak_nothing():
    sched, _ = make(num_slots=1024, mode="inc", **SPEC)
    p = list(range(V)) + [1]
    res = Results()
    sched.handle(gen("a", p, 40))
    sched.handle(gen("b", p + [2], 40))
    for _ in range(3):
        step(sched, res)
    assert sched.spec.stats["spec_verify_ct"] > 0
    sched.handle(AbortReq(rid="a"))
    drain(sched, res)
    assert res.final("a").finish_reason["type"] == "abort"
    assert res.ids("b") == reference(p + [2], 40, "inc")
    # a pool so small that requests are retracted while they speculate
    sched, _ = make(num_slots=180, mode="hash", **SPEC)
    ps = {f"t{i}": list(range(V)) + prompt(6, seed=i) for i in range(3)}
    res = Results()
    for rid, q in ps.items():
        sched.handle(gen(rid, q, 40))
    drain(sched, res)
    assert sched.stats["num_retracted_reqs"] > 0
    for rid, q in ps.items():
        assert res.ids(rid) == reference(q, 40, "hash"), rid


def test_bad_settings_fail_loud():
    with pytest.raises(ValueError, match="speculative-algorithm"):
        make(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="page-size 1"):
        make(page_size=4, **SPEC)


def test_metrics_and_meta_info_report_speculation():
    from runtime.messages import ReqTextOut
    from server.metrics import Metrics

    text = Metrics().render("sglang", "smol", {"spec_verify_ct": 4, "spec_accept_length": 2.5, "spec_accept_rate": 0.375})
    assert 'sglang:spec_accept_length{model_name="smol"} 2.5' in text
    assert 'sglang:spec_accept_rate{model_name="smol"} 0.375' in text
    assert "spec_accept_rate" not in Metrics().render("sglang", "smol", {})  # speculation off: no series
    sched, _ = make(mode="inc", **SPEC)
    sched.handle(gen("m", list(range(V)) + [5], 12))
    out = drain(sched).final("m")
    assert out.spec_verify_ct > 0 and out.spec_accepted_tokens > 0
    assert ReqTextOut(rid="m", text_delta="", new_ids=[], spec_verify_ct=2).spec_verify_ct == 2


def test_fault_in_the_middle_of_a_verify_step_aborts_only_that_request(monkeypatch):
    """Token 3 of "bad" is the second token one verify step emits (tokens 2..5): the request ends there with
    an internal-error abort, its row keeps exactly the KV of the tokens before, and nothing leaks."""
    monkeypatch.setenv("RADIXGEN_FAULT_INJECT_RID", "bad")
    monkeypatch.setenv("RADIXGEN_FAULT_INJECT_AT_TOKEN", "3")
    sched, _ = make(mode="inc", **SPEC)
    p = list(range(V)) + [7]
    sched.handle(gen("bad", p, 20))
    sched.handle(gen("ok", p + [8], 20))
    res = drain(sched)
    assert res.final("bad").finish_reason["message"].startswith("internal error while processing request")
    assert res.ids("bad") == reference(p, 3, "inc")
    assert res.final("bad").spec_verify_ct == 1
    assert res.ids("ok") == reference(p + [8], 20, "inc")
    sched.kv.tree.check_integrity()
