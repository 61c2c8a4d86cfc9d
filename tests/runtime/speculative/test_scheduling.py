"""Speculative decoding (n-gram proposer) in the scheduler, with the fake runner of test_scheduler.py.

The fake runner's next token is a function of the tokens read through the request's table row, so a draft
slot left in the row, a freed slot read back or a wrong position changes (or breaks) the output. Every test
compares with `reference()` and checks the strict slot invariant after every step and at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.messages import AbortReq, FinishStop
from runtime.speculative import accept_greedy, propose_ngram
from tests.runtime.scheduler.harness import (
    OnlyToken,
    Results,
    V,
    create_scheduler,
    drain,
    gen,
    inject_fault,
    prompt,
    reference,
    step,
)

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
    sched, _ = create_scheduler(num_slots=1024, mode=mode, chunked_prefill_size=16, **SPEC)
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
    sched, _ = create_scheduler(mode="inc", **SPEC)
    p = list(range(V)) + [10]
    res = Results()
    sched.handle(gen("eos", p, 30, stop_token_ids=[17]))
    sched.handle(gen("len", p, 6))
    drain(sched, res)
    assert res.ids("eos") == list(range(11, 18))  # stops at 17, which the drafts never propose
    assert res.final("eos").finish_reason == FinishStop(matched=17)
    assert res.ids("len") == list(range(11, 17))
    assert res.final("len").finish_reason.type == "length"


def test_streamed_outputs_arrive_in_order():
    sched, _ = create_scheduler(mode="inc", **SPEC)
    p = list(range(V)) + [3]
    sched.handle(gen("s", p, 20))
    res = drain(sched)
    chunks = [o.new_ids for o in res["s"]]
    assert [t for c in chunks for t in c] == reference(p, 20, "inc")
    assert max(len(c) for c in chunks) > 1  # several tokens per step: they came from verify steps


def test_abort_after_a_verify_step_and_retraction_leak_nothing():
    sched, _ = create_scheduler(num_slots=1024, mode="inc", **SPEC)
    p = list(range(V)) + [1]
    res = Results()
    sched.handle(gen("a", p, 40))
    sched.handle(gen("b", p + [2], 40))
    for _ in range(3):
        step(sched, res)
    assert sched.spec.stats["spec_verify_ct"] > 0
    sched.handle(AbortReq(rid="a"))
    drain(sched, res)
    assert res.final("a").finish_reason.type == "abort"
    assert res.ids("b") == reference(p + [2], 40, "inc")
    # a pool so small that requests are retracted while they speculate
    sched, _ = create_scheduler(num_slots=180, mode="hash", **SPEC)
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
        create_scheduler(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="page-size 1"):
        create_scheduler(page_size=4, **SPEC)


def test_metrics_and_meta_info_report_speculation():
    from runtime.messages import ReqTextOut
    from server.metrics import Metrics

    text = Metrics().render("sglang", "smol", {"spec_verify_ct": 4, "spec_accept_length": 2.5, "spec_accept_rate": 0.375})
    assert 'sglang:spec_accept_length{model_name="smol"} 2.5' in text
    assert 'sglang:spec_accept_rate{model_name="smol"} 0.375' in text
    assert "spec_accept_rate" not in Metrics().render("sglang", "smol", {})  # speculation off: no series
    sched, _ = create_scheduler(mode="inc", **SPEC)
    sched.handle(gen("m", list(range(V)) + [5], 12))
    out = drain(sched).final("m")
    assert out.spec_verify_ct > 0 and out.spec_accepted_tokens > 0
    assert ReqTextOut(rid="m", text_delta="", new_ids=[], spec_verify_ct=2).spec_verify_ct == 2


def test_fault_in_the_middle_of_a_verify_step_aborts_only_that_request(monkeypatch):
    """Token 3 of "bad" is the second token one verify step emits (tokens 2..5): the request ends there with
    an internal-error abort, its row keeps exactly the KV of the tokens before, and nothing leaks."""
    sched, _ = create_scheduler(mode="inc", **SPEC)
    inject_fault(sched, "bad", 3)
    p = list(range(V)) + [7]
    sched.handle(gen("bad", p, 20))
    sched.handle(gen("ok", p + [8], 20))
    res = drain(sched)
    assert res.final("bad").finish_reason.message.startswith("internal error while processing request")
    assert res.ids("bad") == reference(p, 3, "inc")
    assert res.final("bad").spec_verify_ct == 1
    assert res.ids("ok") == reference(p + [8], 20, "inc")
    sched.kv.tree.check_integrity()


# ---------------------------------------------------------------------------------------------- adaptive pause
# "inc" mode continues t with t + 1, but this prompt holds every value t followed by t + 3: the n-gram lookup
# always proposes [t + 3, t + 6, ...] for the outputs 1, 2, 3, ... (each seen once), and always misses.
MISS = [(3 * j) % V for j in range(V + 1)]


def row_kinds(sched, rid: str) -> str:
    """`rid`'s row in each step after its prefill: "V" a verify row (it proposed), "d" a plain decode row."""
    kinds = ["d" if rids.index(rid) < nd else "V" for nd, rids, _, _ in sched.steps if rid in rids]
    return "".join(kinds[1:])


def test_rejected_drafts_pause_proposing_for_a_while():
    """Every verify step accepts 0 drafts: the average (0) is below 1, so each proposal is followed by a pause,
    each pause twice the one before (2, 4, 8, 16) up to 8x the base (16), outputs unchanged."""
    sched, _ = create_scheduler(mode="inc", **{**SPEC, "speculative_num_draft_tokens": 2}, speculative_pause_steps=2)
    sched.handle(gen("m", MISS, 50))
    res = drain(sched)
    assert res.ids("m") == reference(MISS, 50, "inc")
    want = "V" + "d" * 2 + "V" + "d" * 4 + "V" + "d" * 8 + "V" + "d" * 16 + "V" + "d" * 16
    assert row_kinds(sched, "m") == want[:49]  # 49 steps after the prefill's token
    st = sched.internal_state()
    assert st["spec_accepted_tokens"] == 0 and st["spec_verify_ct"] == 5 == st["spec_pauses"]
    assert st["spec_paused_steps"] == 49 - 5


def test_accepted_drafts_never_pause():
    sched, _ = create_scheduler(mode="inc", **SPEC, speculative_pause_steps=2)
    p = list(range(V)) + [5]  # outputs 6.. continue the prompt's run: every draft is accepted
    sched.handle(gen("a", p, 30))
    res = drain(sched)
    assert res.ids("a") == reference(p, 30, "inc")
    kinds = row_kinds(sched, "a")
    assert kinds and set(kinds) == {"V"}
    assert sched.internal_state()["spec_pauses"] == 0


def test_min_accept_zero_never_pauses():
    sched, _ = create_scheduler(mode="inc", **SPEC, speculative_min_accept=0.0, speculative_pause_steps=2)
    sched.handle(gen("m", MISS, 20))
    sched.handle(gen("p", MISS + [7], 20, disable_speculation=True))  # a plain row in the same batches
    res = drain(sched)
    assert res.ids("m") == reference(MISS, 20, "inc") and res.ids("p") == reference(MISS + [7], 20, "inc")
    assert row_kinds(sched, "m") == "V" * 19 and set(row_kinds(sched, "p")) == {"d"}
    st = sched.internal_state()
    assert st["spec_pauses"] == st["spec_paused_steps"] == 0


def test_paused_and_speculating_requests_share_batches_with_unchanged_outputs():
    """"m" pauses while "a" keeps verifying in the same steps; then hash-mode requests over repeated prompts
    (some drafts accepted, most not) with the default pause settings, against the reference."""
    sched, _ = create_scheduler(mode="inc", **SPEC, speculative_pause_steps=2)
    sched.handle(gen("m", MISS, 24))
    sched.handle(gen("a", list(range(V)) + [5], 24))
    res = drain(sched)
    assert res.ids("m") == reference(MISS, 24, "inc") and res.ids("a") == reference(list(range(V)) + [5], 24, "inc")
    assert "d" in row_kinds(sched, "m") and set(row_kinds(sched, "a")) == {"V"}
    sched, _ = create_scheduler(mode="hash", **SPEC)
    ps = {f"h{i}": prompt(30, seed=i) + prompt(30, seed=i) for i in range(3)}
    for rid, q in ps.items():
        sched.handle(gen(rid, q, 40))
    res = drain(sched)
    for rid, q in ps.items():
        assert res.ids(rid) == reference(q, 40, "hash"), rid
    st = sched.internal_state()
    assert st["spec_pauses"] > 0 and st["spec_accepted_tokens"] > 0


def test_recovered_average_resets_the_pause_length():
    """The rule itself: EMA weight 0.5 from the first verify step; below 1 pauses (2, then doubled while it
    has not recovered), back at >= 1 the next pause is the base length again."""
    from runtime.sampling.params import SamplingParams
    from runtime.scheduler.core import Req
    from runtime.scheduler.speculative import pause_after_verify

    req = Req("r", [1], SamplingParams())

    def verify(accepted: int) -> tuple[bool, float, int]:
        req.spec.verify_ct += 1
        paused = pause_after_verify(req, accepted, 1.0, 2)
        assert req.spec.pause == (req.spec.pause_len if paused else 0)
        req.spec.pause = 0  # the pause runs out
        return paused, req.spec.accept_avg, req.spec.pause_len

    assert verify(0) == (True, 0.0, 2)
    assert verify(0) == (True, 0.0, 4)
    assert verify(4) == (False, 2.0, 0)  # recovered
    assert verify(0) == (False, 1.0, 0)  # 1.0 is not below 1.0
    assert verify(0) == (True, 0.5, 2)  # base again
    assert [verify(0)[2] for _ in range(4)] == [4, 8, 16, 16]  # capped at 8x
    assert pause_after_verify(req, 0, 0.0, 2) is False and req.spec.pause_len == 0  # 0 never pauses


def test_pause_settings_are_validated_and_reach_the_cli():
    from server.cli import build_parser, config_from_args

    with pytest.raises(ValueError, match="--speculative-min-accept must be >= 0"):
        create_scheduler(speculative_min_accept=-0.5, **SPEC)
    with pytest.raises(ValueError, match="--speculative-pause-steps must be at least 1"):
        create_scheduler(speculative_pause_steps=0, **SPEC)
    parser = build_parser()
    ns = parser.parse_args(["serve", "--speculative-min-accept", "0.5", "--speculative-pause-steps", "4"])
    sp = config_from_args(ns).speculative
    assert (sp.speculative_min_accept, sp.speculative_pause_steps) == (0.5, 4)
    helps = {a.dest: a.help for a in parser._subparsers._group_actions[0].choices["serve"]._actions}
    assert "moving average" in helps["speculative_min_accept"] and "8x" in helps["speculative_pause_steps"]


def test_a_json_requests_closing_window_is_not_drafted():
    """The closing window (runtime/constrained/closing.py) samples token by token: a JSON request whose next
    verify step could reach its last min(reserve, max_new_tokens / 4) tokens gets no proposals; with the window
    off, or without a JSON schema, the budget is as before."""
    from types import SimpleNamespace

    from runtime.config import SpeculativeConfig
    from runtime.sampling.params import SamplingParams
    from runtime.scheduler.core import Req
    from runtime.scheduler.speculative import Speculator

    cfg = SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    kv = SimpleNamespace(on_release=[])
    on, off = (Speculator(cfg, kv, frozenset(), V, close_reserve=r) for r in (128, 0))  # type: ignore[arg-type]

    def req(out: int, **kw) -> Req:
        r = Req("r", [1], SamplingParams(max_new_tokens=100, **kw))
        r.grammar = OnlyToken(5, 1000)  # a grammar (it can check proposals)
        r.output_ids = [5] * out
        return r

    js = {"json_schema": '{"type": "object"}'}
    # max_new_tokens 100: the window is the last 25 tokens; a 4-token verify step from 30 left could reach it
    assert on._budget(req(60, **js)) == 4 and on._budget(req(70, **js)) == 4
    assert on._budget(req(71, **js)) == 0 and on._budget(req(90, **js)) == 0
    assert off._budget(req(90, **js)) == 4 and off._budget(req(97, **js)) == 3
    assert on._budget(req(90, regex="[a-z]+")) == 4
