"""Per-request error isolation in the scheduler, with the fake runner of test_scheduler.py (no model).

A failpoint (`inject_fault`, tests/runtime/scheduler/harness.py) makes the result processor raise while
processing one request's sampled token: only that request ends, with an "internal error" abort, its slots go
back through the normal finish path (strict memory check every step), and every other request of the same
batches produces exactly its reference tokens.
"""

from __future__ import annotations

import logging

import pytest

from runtime.messages import AbortReq, FinishAbort
from tests.runtime.scheduler.harness import (
    FakeGrammars,
    OnlyToken,
    Results,
    create_scheduler,
    drain,
    gen,
    inject_fault,
    prompt,
    reference,
    step,
)


@pytest.mark.parametrize("at_token", [1, 4])  # 1: raised in the prefill step; 4: in a decode step
def test_injected_fault_aborts_only_that_request(monkeypatch, caplog, at_token: int) -> None:
    sched, _ = create_scheduler(num_slots=256, max_running=8)
    inject_fault(sched, "bad", at_token)
    prompts = {f"ok{i}": prompt(5 + i, seed=i) for i in range(5)}
    prompts["bad"] = prompt(7, seed=99)
    prompts["bad_0"] = prompt(7, seed=99)  # a rid that merely starts with the poisoned one is untouched
    for rid, p in prompts.items():
        sched.handle(gen(rid, p, max_new=8))
    with caplog.at_level(logging.ERROR, logger="runtime.scheduler.output"):
        res = drain(sched)
    fr = res.final("bad").finish_reason
    assert fr.type == "abort", fr
    assert fr.message.startswith(
        "internal error while processing request: RuntimeError: injected fault"
    ), fr
    assert res.ids("bad") == reference(prompts["bad"], 8)[:at_token]  # what it had sampled when it failed
    for rid in [r for r in prompts if r != "bad"]:
        assert res.final(rid).finish_reason.type == "length", rid
        assert res.ids(rid) == reference(prompts[rid], 8), rid
    assert any(
        "internal error while processing request bad" in r.getMessage() and r.exc_info for r in caplog.records
    )
    assert not sched.running and not sched.waiting


def test_rid_reusable_and_scheduler_keeps_serving(monkeypatch) -> None:
    sched, _ = create_scheduler(num_slots=128, max_running=4)
    inject_fault(sched, "bad", 2)
    for round_ in range(3):  # the same scheduler after each failure: the failpoint fires again, others fine
        sched.handle(gen("bad", prompt(6, seed=round_), max_new=6))
        sched.handle(gen(f"ok{round_}", prompt(9, seed=10 + round_), max_new=6))
        res = drain(sched)
        assert res.final("bad").finish_reason.type == "abort"
        assert res.ids(f"ok{round_}") == reference(prompt(9, seed=10 + round_), 6)


def test_same_rid_without_a_failpoint_is_served_normally() -> None:
    sched, _ = create_scheduler()
    sched.handle(gen("bad", prompt(6), max_new=5))
    res = drain(sched)
    assert res.final("bad").finish_reason.type == "length"
    assert res.ids("bad") == reference(prompt(6), 5)


class BrokenTermination(OnlyToken):
    """A grammar whose `is_terminated` raises (outside the grammar's own accept_token guard): a plain bug."""

    def copy(self) -> BrokenTermination:
        return BrokenTermination(self.tok, self.n)

    def is_terminated(self) -> bool:
        if len(self.seen) >= 2:
            raise KeyError("state 17")
        return False


def test_bug_in_one_requests_grammar_aborts_only_it(monkeypatch) -> None:
    backend = FakeGrammars()
    sched, _ = create_scheduler(grammar_backend=backend)
    sched.handle(gen("g", prompt(5), 10, regex="x+"))
    sched.handle(gen("plain", prompt(6), 6))
    backend.futures[0].set_result(BrokenTermination(9, 5))
    res = drain(sched)
    fr = res.final("g").finish_reason
    assert fr.type == "abort" and fr.message.startswith(
        "internal error while processing request: KeyError"
    )
    assert res.ids("g") == [9, 9]
    assert res.ids("plain") == reference(prompt(6), 6)


def test_abort_while_grammar_compiles(monkeypatch) -> None:
    backend = FakeGrammars()
    sched, _ = create_scheduler(grammar_backend=backend)
    sched.handle(gen("g", prompt(5), 10, regex="x+"))
    sched.handle(gen("plain", prompt(6), 6))
    res = Results()
    step(sched, res)
    assert sched.internal_state()["num_grammar_queue_reqs"] == 1
    sched.handle(AbortReq(rid="g"))
    assert backend.futures[0].cancelled()  # the compile is dropped, not only the request
    res = drain(sched, res)
    assert res.final("g").finish_reason == FinishAbort(message="aborted by client")
    assert res.ids("g") == [] and res.ids("plain") == reference(prompt(6), 6)
    sched.handle(gen("g", prompt(5), 4))  # the rid is free again
    assert drain(sched).ids("g") == reference(prompt(5), 4)
