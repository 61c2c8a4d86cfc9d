"""Predicted outputs (OpenAI `prediction`) as the n-gram proposer's draft source, with the fake runner of
test_scheduler.py: the output equals the reference whatever the prediction says, a right prediction is
accepted (counted in the speculative stats), a wrong one only costs rejected drafts."""

from __future__ import annotations

import numpy as np

from runtime.messages import TokenizedGenerateReq
from runtime.sampling.params import SamplingParams
from runtime.speculative import propose_from_source
from tests.runtime.scheduler.harness import create_scheduler as make
from tests.runtime.scheduler.harness import drain, prompt, reference

SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}


def arr(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def test_lookup_in_the_prediction_keeps_its_place():
    src = arr([1, 2, 9, 1, 2, 7, 8, 1, 2, 5])
    # "1 2" occurs at 0, 3 and 7: from cursor 0 the first one continues, later cursors move on
    assert propose_from_source(src, arr([4, 1, 2]), 2, 1, 2, 0) == ([9, 1], 2)
    assert propose_from_source(src, arr([4, 1, 2]), 2, 1, 2, 3) == ([7, 8], 5)
    assert propose_from_source(src, arr([4, 1, 2]), 3, 1, 2, 9) == ([5], 9)  # past every hit: the last one
    assert propose_from_source(src, arr([3, 3]), 2, 1, 2, 0) == ([], 0)
    assert propose_from_source(arr([6]), arr([6]), 2, 1, 2, 0) == ([], 0)  # nothing follows


def gen(rid: str, p: list[int], max_new: int, prediction: list[int] | None) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=p, prediction_ids=prediction,
                                sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0))


def run(prediction_of, n: int = 40):
    sched, _ = make(num_slots=1024, mode="hash", **SPEC)
    ps = {f"r{i}": prompt(16, seed=30 + i) for i in range(3)}
    for rid, p in ps.items():
        sched.handle(gen(rid, p, n, prediction_of(p, n)))
    res = drain(sched)
    for rid, p in ps.items():
        assert res.ids(rid) == reference(p, n, "hash"), rid
    return sched.internal_state(), res


def test_a_right_prediction_is_accepted_and_the_output_is_unchanged():
    st, res = run(lambda p, n: reference(p, n, "hash"))
    assert st["spec_accept_rate"] > 0.9 and st["spec_accept_length"] > 4.0
    assert all(res.final(r).spec_verify_ct <= 10 for r in ("r0", "r1", "r2"))


def test_a_lightly_edited_prediction_is_still_mostly_accepted():
    def edited(p, n):
        ref = reference(p, n, "hash")
        return ref[:15] + [(ref[15] + 1) % 64] + ref[16:]  # one token differs

    st, _ = run(edited)
    assert st["spec_accept_rate"] > 0.6


def test_a_wrong_prediction_changes_nothing_but_the_accept_rate():
    st, _ = run(lambda p, n: prompt(n, seed=99))
    assert st["spec_draft_tokens"] > 0 or st["spec_verify_ct"] == 0
    st_none, _ = run(lambda p, n: None)
    assert st["spec_accept_rate"] <= 0.5 and st_none["spec_accept_rate"] <= 0.5
