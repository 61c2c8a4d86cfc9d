"""A thinking request through the scheduler (fake runner, runtime/constrained/thinking.py): free tokens until the
budget, then only the end-of-thinking marker, then free again; a scheduler without token bytes refuses it."""

from __future__ import annotations

from tests.runtime.scheduler.harness import create_scheduler, drain, gen, prompt, reference

MARKER = {60: b"<", 61: b"/", 62: b"t", 63: b">"}


def token_bytes(i: int) -> bytes:
    return MARKER.get(i, bytes([97 + i % 26]))


def test_budget_forces_the_marker_then_the_answer_is_free():
    sched, _ = create_scheduler(token_bytes_fn=token_bytes, eos=frozenset({0}))
    p = prompt(12, 3)
    sched.handle(gen("t", p, 12, think_end="</t>", thinking_budget=4, ignore_eos=True))
    out = drain(sched).ids("t")
    free = reference(p, 4, eos=frozenset())
    assert out[:4] == free  # thinking: the model's own tokens, unmasked
    # the budget is spent: the marker, by whichever tokens spell it (19 spells "t" too)
    assert b"".join(token_bytes(t) for t in out[4:8]) == b"</t>"
    assert len(out) == 12


def test_without_token_bytes_a_thinking_request_is_aborted():
    sched, _ = create_scheduler()
    sched.handle(gen("t", prompt(8, 1), 4, think_end="</t>", thinking_budget=2))
    res = drain(sched)
    fr = res.final("t").finish_reason
    assert fr.type == "abort" and "think_end" in fr.message
