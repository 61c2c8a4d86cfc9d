"""Priority scheduling (--enable-priority-scheduling) with the fake runner of test_scheduler: the waiting
order, preemption of lower-priority running requests (and its threshold), and outputs that never depend on
either (every request's tokens equal the reference)."""

from __future__ import annotations

from runtime.messages import TokenizedGenerateReq
from runtime.sampling.params import SamplingParams
from tests.runtime.scheduler.harness import Results, drain, prompt, reference, step
from tests.runtime.scheduler.harness import create_scheduler as make


def gen(rid: str, p: list[int], max_new: int, priority: int) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=p, priority=priority,
                                sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0))


def admitted_order(sched) -> list[str]:
    return [rid for dec, rids, _, _ in sched.batches if not dec for rid in rids]


def test_waiting_order_is_by_priority_then_policy():
    for low_first, expect in ((False, ["hi", "mid_a", "mid_b", "lo"]), (True, ["lo", "mid_a", "mid_b", "hi"])):
        sched, _ = make(max_running=1, schedule_policy="fcfs", enable_priority_scheduling=True,
                        schedule_low_priority_values_first=low_first, priority_scheduling_preemption_threshold=100)
        prompts = {"lo": prompt(8, 1), "mid_a": prompt(8, 2), "hi": prompt(8, 3), "mid_b": prompt(8, 4)}
        for rid, pr in zip(prompts, (0, 5, 9, 5), strict=True):
            sched.handle(gen(rid, prompts[rid], 3, pr))
        res = drain(sched)
        assert admitted_order(sched) == expect
        assert sched.internal_state()["num_preempted_reqs"] == 0
        for rid, p in prompts.items():
            assert res.ids(rid) == reference(p, 3)


def test_priority_is_ignored_when_off():
    sched, _ = make(max_running=1, schedule_policy="fcfs")
    for rid, pr in (("a", 0), ("b", 50)):
        sched.handle(gen(rid, prompt(8, ord(rid)), 2, pr))
    drain(sched)
    assert admitted_order(sched) == ["a", "b"]


def _preempt_run(priority: int, threshold: int = 10, **cfg):
    sched, _ = make(max_running=1, enable_priority_scheduling=True,
                    priority_scheduling_preemption_threshold=threshold, **cfg)
    low, high = prompt(12, 7), prompt(10, 8)
    sched.handle(gen("low", low, 30, 0))
    res = Results()
    for _ in range(5):
        step(sched, res)
    assert len(res.ids("low")) == 5 and [r.rid for r in sched.running] == ["low"]
    sched.handle(gen("high", high, 6, priority))
    step(sched, res)
    preempted = [r.rid for r in sched.running] == ["high"]
    res = drain(sched, res)
    assert res.ids("low") == reference(low, 30) and res.ids("high") == reference(high, 6)
    return sched, res, preempted


def test_higher_priority_preempts_a_running_request_and_outputs_stay_exact():
    sched, res, preempted = _preempt_run(priority=11)
    assert preempted
    assert res.final("low").num_retractions == 1 and res.final("high").num_retractions == 0
    st = sched.internal_state()
    assert st["num_preempted_reqs"] == 1 and st["num_retracted_reqs"] == 1
    # the retracted request's prompt and output so far were cached: its readmission is a cache hit
    readmit = [c for dec, rids, c, _ in sched.batches if not dec and rids == ["low"]]
    assert len(readmit) == 2 and readmit[1][0] >= 12 + 5 - 1


def test_no_preemption_within_the_threshold():
    sched, res, preempted = _preempt_run(priority=10)
    assert not preempted and res.final("low").num_retractions == 0
    assert sched.internal_state()["num_preempted_reqs"] == 0


def test_preemption_for_kv_room_retracts_the_lowest_priority_first():
    # room for two running requests' prompts but not a third: the 0-priority one goes, the 5 stays
    sched, _ = make(num_slots=80, max_running=4, enable_priority_scheduling=True,
                    priority_scheduling_preemption_threshold=3, schedule_conservativeness=0.3)
    ps = {"p0": prompt(20, 1), "p5": prompt(20, 2), "top": prompt(30, 3)}
    sched.handle(gen("p0", ps["p0"], 20, 0))
    sched.handle(gen("p5", ps["p5"], 20, 5))
    res = Results()
    for _ in range(3):
        step(sched, res)
    assert {r.rid for r in sched.running} == {"p0", "p5"}
    sched.handle(gen("top", ps["top"], 4, 9))
    step(sched, res)
    assert {r.rid for r in sched.running} == {"p5", "top"}
    res = drain(sched, res)
    assert res.final("p0").num_retractions >= 1 and res.final("p5").num_retractions == 0
    for rid, p in ps.items():
        assert res.ids(rid) == reference(p, 20 if rid != "top" else 4)
