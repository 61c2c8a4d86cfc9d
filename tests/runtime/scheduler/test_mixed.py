"""Mixed prefill+decode steps, same-step prefix sharing and the stall counter, on the fake runner of
test_scheduler.py (no model): what each step carries, how many tokens the forwards compute, and that greedy
outputs always equal the unbatched `reference()` while the strict slot invariant holds after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.messages import AbortReq
from tests.runtime.scheduler.harness import (
    FakeGrammar,
    FakeGrammars,
    Results,
    create_scheduler,
    drain,
    gen,
    next_token,
    prompt,
    reference,
    step,
)


def extend_tokens(runner) -> int:
    """New tokens the forwards computed in extend rows (prompt chunks, readmissions, jump-forward extends)."""
    return sum(sum(fb.extend_lens[fb.num_decode :]) for fb in runner.calls)


# ---------------------------------------------------------------------------------------------- mixed steps
@pytest.mark.parametrize("mixed", [True, False])
def test_decode_gets_a_token_every_step_while_a_4000_token_prompt_chunks_in(mixed):
    sched, runner = create_scheduler(num_slots=8192, max_running=8, max_context=4100, chunked_prefill_size=512,
                         disable_mixed_steps=not mixed)
    shorts = {f"d{i}": prompt(30, i) for i in range(4)}
    for rid, p in shorts.items():
        sched.handle(gen(rid, p, 40))
    res = Results()
    step(sched, res)  # the four short prompts, one prefill step
    long = prompt(4000, 99)
    sched.handle(gen("long", long, 3))
    chunk_steps = 0
    while "long" not in res:
        before = {rid: len(res.ids(rid)) for rid in shorts}
        step(sched, res)
        chunk_steps += 1
        got = [len(res.ids(rid)) - before[rid] for rid in shorts]
        if mixed:
            assert got == [1, 1, 1, 1], f"step {chunk_steps}: a decode row got no token"
            num_decode, rids, _, ext = sched.steps[-1]
            assert num_decode == 4 and rids[4:] == ["long"] and sum(ext) <= 512
    if mixed:
        assert chunk_steps == -(-4000 // (512 - 4))  # the decode rows share the 512-token budget
        assert sched.internal_state()["stall_steps"] == 0
    else:
        st = sched.internal_state()
        assert st["stall_steps"] == st["stall_steps_prefill_only"] == chunk_steps == 4000 // 512 + 1
    res = drain(sched, res)
    for rid, p in {**shorts, "long": long}.items():
        assert res.ids(rid) == reference(p, 40 if rid != "long" else 3)
    assert sched.internal_state()["mixed_steps"] == (chunk_steps if mixed else 0)


# ---------------------------------------------------------------------------------------------- same-step sharing
@pytest.mark.parametrize("chunk", [512, 2048])
def test_32_requests_over_a_new_1500_token_prefix_compute_it_once(chunk):
    sched, runner = create_scheduler(num_slots=8192, max_running=40, max_context=1600, chunked_prefill_size=chunk)
    doc = prompt(1500, 7)
    qs = {f"q{i}": doc + [i] + prompt(19, 100 + i) for i in range(32)}  # distinct first question tokens
    for rid, p in qs.items():
        sched.handle(gen(rid, p, 4))
    res, first = Results(), {}
    for n in range(100):
        if not sched.has_work():
            break
        step(sched, res)
        first.update({rid: n for rid in res if rid not in first})
    res = drain(sched, res)
    assert extend_tokens(runner) == 1500 + 32 * 20  # the document once, each question once
    # The step computing the document's last token, and everyone's first token within 2 steps of it.
    last_doc = next(n for n, (nd, _, c, e) in enumerate(sched.steps)
                    if any(ci <= 1499 < ci + ei for ci, ei in zip(c[nd:], e[nd:], strict=True)))
    assert max(first.values()) <= last_doc + 2, (last_doc, first)
    for rid, p in qs.items():
        assert res.ids(rid) == reference(p, 4)
    assert sched.internal_state()["cache_hit_rate"] == pytest.approx(31 * 1500 / (32 * 1520))


def test_same_step_sharing_with_a_chunked_document_holder():
    """A request arriving while another computes a shared document in chunks waits for it instead of
    computing it again, and the tree holds each chunk (locked) from the step that computes it."""
    sched, runner = create_scheduler(num_slots=2048, max_context=600, chunked_prefill_size=128)
    doc = prompt(500, 3)
    sched.handle(gen("a", doc + prompt(10, 4), 3))
    res = Results()
    step(sched, res)
    assert sched.kv.tree.match_prefix(doc, record=False).length == 128 and sched.kv.locked_size() == 128
    sched.handle(gen("b", doc + prompt(10, 5), 3))
    res = drain(sched, res)
    assert extend_tokens(runner) == 500 + 2 * 10
    assert res.final("b").cached_tokens == 500


# ---------------------------------------------------------------------------------------------- jump-forward
class AnyToken(FakeGrammar):
    """A grammar that allows every token and never terminates (jump-forward is faked by the test)."""

    def copy(self) -> AnyToken:
        return AnyToken()

    def write_bitmask(self, row: torch.Tensor) -> None:
        row.fill_(-1)


def test_jump_forward_extends_ride_in_decode_steps(monkeypatch):
    backend = FakeGrammars()
    sched, runner = create_scheduler(grammar_backend=backend)
    proc = sched.processor
    proc.jump_encode = lambda text: []  # jump-forward on; the fake below decides what is forced

    def force_three(req, grammar, encode):  # after every 4th token, append the next 3 greedy tokens at once
        if len(req.output_ids) % 4 == 1 and req.remaining_new_tokens > 3:
            seq = req.origin_input_ids + req.output_ids
            for _ in range(3):
                seq.append(next_token(seq, "hash"))
            req.output_ids.extend(seq[-3:])
            req.grammar_state.jump_tokens = 3

    monkeypatch.setattr(proc, "_jump_forward", force_three)
    pj, pd = prompt(12, 1), prompt(9, 2)
    sched.handle(gen("j", pj, 30, regex="."))
    sched.handle(gen("d", pd, 30))
    backend.futures[0].set_result(AnyToken())
    res = drain(sched)
    assert res.ids("j") == reference(pj, 30) and res.ids("d") == reference(pd, 30)
    jumps = [(nd, rids, e) for nd, rids, _, e in sched.steps if "j" in rids[nd:] and e[rids.index("j")] == 4]
    assert len(jumps) >= 4
    assert all(rids[:nd] == ["d"] for nd, rids, _ in jumps)  # d decodes in the same step
    st = sched.internal_state()
    assert st["jump_forward_tokens"] == 3 * len(jumps) and st["stall_steps"] == 0


# ---------------------------------------------------------------------------------------------- property test
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_arrivals_aborts_chunks_and_pool_pressure(data):
    """Invariants after every step (strict slot accounting, tree integrity at the end) and greedy outputs
    equal to the unbatched reference, whatever arrives when, what is aborted, the chunk size and the pool."""
    draw = data.draw
    sched, _ = create_scheduler(
        num_slots=draw(st.sampled_from([48, 64, 96, 160, 400]), label="slots"),
        max_running=draw(st.integers(1, 6), label="rows"),
        chunked_prefill_size=draw(st.sampled_from([-1, 4, 7, 16, 64]), label="chunk"),
        disable_mixed_steps=draw(st.booleans(), label="separated"),
        disable_radix_cache=draw(st.sampled_from([False, False, True]), label="no_cache"),
        schedule_conservativeness=draw(st.sampled_from([0.05, 1.0]), label="conservativeness"),
        schedule_policy=draw(st.sampled_from(["lpm", "fcfs", "dfs-weight"]), label="policy"),
    )
    docs = [prompt(24, 1), prompt(16, 2)]
    prompts: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    res = Results()
    for t in range(draw(st.integers(1, 20), label="steps")):
        for _ in range(draw(st.integers(2 if t == 0 else 0, 4))):
            rid = f"r{len(prompts)}"
            if prompts and draw(st.integers(0, 3)) == 0:  # the same prompt again (n > 1 copies, retries)
                p = prompts[draw(st.sampled_from(sorted(prompts)))][0]
            else:
                doc = draw(st.sampled_from([[], docs[0], docs[1], docs[0][:10]]))
                p = doc + draw(st.lists(st.integers(0, 63), min_size=1, max_size=12))
            prompts[rid] = (p, draw(st.integers(1, 30)))
            sched.handle(gen(rid, *prompts[rid]))
        if prompts and draw(st.integers(0, 5)) == 0:
            rid = draw(st.sampled_from(sorted(prompts)))
            aborted.add(rid)
            sched.handle(AbortReq(rid=rid))
        step(sched, res)
    res = drain(sched, res)
    for rid, (p, max_new) in prompts.items():
        out, reason = res.ids(rid), res.final(rid).finish_reason
        if reason.type == "abort":  # by the client, or a request the tiny pool can never hold
            assert out == reference(p, max_new)[: len(out)]
            assert rid in aborted or "KV" in reason.message, reason
        else:
            assert out == reference(p, max_new), rid
