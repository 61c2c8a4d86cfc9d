"""Speculative decoding with a draft model, on the fake runners of test_scheduler.py (target and draft).

The draft is a second fake runner with its own table and poisoning allocator: its guess reads the tokens
through the request's draft row, so a stale or freed draft slot fails its read check. After every step the
test checks that each request's draft K/V holds exactly its own tokens (`draft_kv_ok`) and the strict
check of both pools (Scheduler.check_memory includes the draft's); outputs always equal `reference()`.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from runtime.config import make_config, resolve
from runtime.constrained.seam import BaseGrammarBackend
from runtime.executor.memory import ReqToTokenTable
from runtime.messages import AbortReq, FinishStop
from runtime.scheduler import Scheduler
from runtime.scheduler.speculative import create_speculator
from tests.runtime.scheduler.harness import (
    FakeGrammar,
    FakeRunner,
    PoisonAllocator,
    Results,
    V,
    create_scheduler,
    gen,
    inject_fault,
    next_token,
    prompt,
    reference,
)

SPEC = {"speculative_algorithm": "draft", "speculative_draft_model_path": __file__, "speculative_num_draft_tokens": 4}


class FakeDraft(FakeRunner):
    """A fake draft model: `mode`'s next token, off by one where `wrong(tokens)` holds."""

    def __init__(self, num_slots: int, mode: str, wrong=lambda toks: False, max_running: int = 8) -> None:
        super().__init__(ReqToTokenTable(max_running, 256), num_slots, mode)
        self.req_to_token = self.table
        self.allocator = PoisonAllocator(num_slots, self.kv)
        self.wrong = wrong

    def forward(self, fb):
        self.kv[fb.out_cache_loc] = fb.input_ids
        owner = [b for b, e in enumerate(fb.extend_lens) for _ in range(e)]
        logits = torch.zeros(len(fb.logits_indices), V)
        for k, idx in enumerate(fb.logits_indices.tolist()):
            b, pos = owner[idx], int(fb.positions[idx])
            toks = self.kv[self.table.table[int(fb.req_pool_indices[b]), : pos + 1].to(torch.int64)]
            assert bool((toks >= 0).all()), f"draft read a freed or unwritten slot at position {pos}"
            t = next_token(toks, self.mode)
            logits[k, (t + 1) % V if self.wrong(toks) else t] = 10.0
        return logits


def noisy(toks: torch.Tensor) -> bool:
    return int(toks.sum()) % 3 == 0


def make_draft(draft: FakeDraft, num_slots: int = 512, mode: str = "hash", grammar_backend=None, **cfg):
    """A scheduler over a fake target (`mode`) and the fake `draft`."""
    table = ReqToTokenTable(8, 256)
    runner = FakeRunner(table, num_slots, mode)
    config = make_config(max_total_tokens=num_slots, max_running_requests=8, strict_memory_check=True,
                         **{**SPEC, **cfg})
    return Scheduler(runner, PoisonAllocator(num_slots, runner.kv), table, config, frozenset(), None,
                     grammar_backend, draft_runner=draft)


def draft_kv_ok(sched, draft: FakeDraft) -> None:
    """Every held draft row holds exactly its request's tokens, and only running requests hold rows."""
    live = {id(r) for r in sched.running}
    for req, st in sched.spec.proposer.rows.values():
        assert id(req) in live, f"{req.rid} holds a draft row but is not running"
        assert st.base < 0 and st.kv_len < req.fill_len, (req.rid, st)
        toks = draft.kv[draft.table.table[st.row, : st.kv_len].to(torch.int64)].tolist()
        assert toks == req.fill_ids[: st.kv_len], req.rid


def run(sched, draft: FakeDraft, res: Results | None = None, max_steps: int = 2000) -> Results:
    res = Results() if res is None else res
    for _ in range(max_steps):
        if not sched.has_work():
            break
        for o in sched.step():
            res.setdefault(o.rid, []).append(o)
        sched.check_memory(strict=True)
        draft_kv_ok(sched, draft)
    assert not sched.has_work()
    sched.step()  # idle: the strict check of both pools
    assert sched.check_memory(strict=True)
    assert draft.allocator.available() == draft.allocator.num_slots and not sched.spec.proposer.rows
    assert draft.table.available() == draft.table.size
    return res


@pytest.mark.parametrize("kind", ["exact", "noisy", "other"])
def test_greedy_equals_reference_and_draft_kv_holds_the_accepted_tokens(kind):
    draft = FakeDraft(512, "inc" if kind == "other" else "hash", noisy if kind == "noisy" else lambda t: False)
    sched = make_draft(draft, chunked_prefill_size=16)
    ps = {f"r{i}": prompt(20 + 7 * i, seed=i) for i in range(5)}
    for rid, p in ps.items():
        sched.handle(gen(rid, p, 24, disable_speculation=rid == "r4"))
    res = run(sched, draft)
    for rid, p in ps.items():
        assert res.ids(rid) == reference(p, 24), rid
    st = sched.internal_state()
    assert res.final("r4").spec_verify_ct == 0 and st["spec_verify_ct"] > 0
    rate = st["spec_accept_rate"]
    if kind == "exact":  # a perfect draft: every proposal accepted, 5 tokens per verify step
        assert rate == 1.0 and st["spec_accept_length"] > 4.0
    elif kind == "noisy":
        assert 0.2 < rate < 0.9
    else:  # a useless draft: requests pause, and their draft rows catch up on the paused steps' tokens after
        assert rate < 0.1 and st["spec_pauses"] > 0 and st["spec_paused_steps"] > st["spec_verify_ct"]


def test_stop_token_max_new_tokens_and_streaming():
    draft = FakeDraft(512, "inc")
    sched = make_draft(draft, mode="inc")
    p = list(range(V)) + [10]
    sched.handle(gen("eos", p, 30, stop_token_ids=[17]))
    sched.handle(gen("len", p, 6))
    res = run(sched, draft)
    assert res.ids("eos") == list(range(11, 18))
    assert res.final("eos").finish_reason == FinishStop(matched=17)
    assert res.ids("len") == list(range(11, 17)) and res.final("len").finish_reason.type == "length"
    assert max(len(o.new_ids) for o in res["eos"]) > 1  # several tokens per step


def test_abort_retraction_and_a_small_draft_pool_leak_nothing():
    draft = FakeDraft(512, "hash", noisy)
    sched = make_draft(draft)
    p = prompt(30, 1)
    res = Results()
    sched.handle(gen("a", p, 40))
    sched.handle(gen("b", p + [2], 40))
    for _ in range(4):
        for o in sched.step():
            res.setdefault(o.rid, []).append(o)
    assert sched.spec.proposer.rows and draft.allocator.available() < 512
    sched.handle(AbortReq(rid="a"))
    run(sched, draft, res)
    assert res.final("a").finish_reason.type == "abort"
    assert res.ids("b") == reference(p + [2], 40)
    # a target pool so small that requests are retracted while they speculate
    draft = FakeDraft(512, "hash", noisy)
    sched = make_draft(draft, num_slots=140)
    ps = {f"t{i}": list(range(V)) + prompt(6, seed=i) for i in range(3)}
    for rid, q in ps.items():
        sched.handle(gen(rid, q, 40))
    res = run(sched, draft)
    assert sched.stats["num_retracted_reqs"] > 0
    for rid, q in ps.items():
        assert res.ids(rid) == reference(q, 40), rid
    # a draft pool too small for everyone: some requests go without proposals, outputs unchanged
    draft = FakeDraft(100, "hash")
    sched = make_draft(draft)
    for rid, q in ps.items():
        sched.handle(gen(rid, q, 30))
    res = run(sched, draft)
    for rid, q in ps.items():
        assert res.ids(rid) == reference(q, 30), rid
    assert sched.internal_state()["spec_verify_ct"] > 0


def test_fault_in_the_middle_of_a_verify_step_frees_both_pools(monkeypatch):
    draft = FakeDraft(512, "inc")
    sched = make_draft(draft, mode="inc")
    inject_fault(sched, "bad", 3)
    p = list(range(V)) + [7]
    sched.handle(gen("bad", p, 20))
    sched.handle(gen("ok", p + [8], 20))
    res = run(sched, draft)
    assert res.final("bad").finish_reason.message.startswith("internal error while processing request")
    assert res.ids("bad") == reference(p, 3, "inc") and res.final("bad").spec_verify_ct == 1
    assert res.ids("ok") == reference(p + [8], 20, "inc")


class EvenGrammar(FakeGrammar):
    """Allows the even tokens only; keeps what it accepted (`seen`) so the test can check every rollback."""

    made: list[EvenGrammar] = []

    def copy(self) -> EvenGrammar:
        g = EvenGrammar()
        EvenGrammar.made.append(g)
        return g

    def write_bitmask(self, row: torch.Tensor) -> None:
        row.zero_()
        row[: V // 32] = 0x55555555  # bits 0, 2, 4, ... of every word

    def allows(self, tok: int) -> bool:
        return tok % 2 == 0


class EvenBackend(BaseGrammarBackend):
    def get_future(self, params):
        fut: Future = Future()
        fut.set_result(EvenGrammar())
        return fut


def test_constrained_proposals_follow_the_grammar_and_roll_back():
    outs = {}
    for on in (False, True):
        EvenGrammar.made = []
        draft = FakeDraft(512, "hash", noisy)
        sched = make_draft(draft, grammar_backend=EvenBackend(), speculative_num_draft_tokens=3)
        for i in range(4):
            sched.handle(gen(f"g{i}", prompt(15, seed=i), 20, regex="x", disable_speculation=not on))
        res = run(sched, draft)
        outs[on] = {rid: res.ids(rid) for rid in res}
        assert sorted(g.seen for g in EvenGrammar.made) == sorted(outs[on].values())  # grammar state == output
    assert outs[True] == outs[False] and all(t % 2 == 0 for ids in outs[True].values() for t in ids)
    assert sched.internal_state()["spec_accepted_tokens"] > 0


def test_bad_settings_fail_loud(tmp_path):
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        resolve(make_config(speculative_algorithm="draft"))
    with pytest.raises(ValueError, match="no such file or directory"):
        resolve(make_config(speculative_algorithm="draft", speculative_draft_model_path=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="needs --speculative-algorithm draft"):
        resolve(make_config(speculative_algorithm="ngram", speculative_draft_model_path=str(tmp_path)))
    with pytest.raises(ValueError, match="needs --speculative-algorithm draft"):
        resolve(make_config(speculative_draft_model_path=str(tmp_path)))
    with pytest.raises(ValueError, match="tp-size"):
        resolve(make_config(speculative_algorithm="draft", speculative_draft_model_path=str(tmp_path), tp_size=3))
    cfg = resolve(make_config(**SPEC))
    sched, _ = create_scheduler()
    with pytest.raises(ValueError, match="no draft model runner"):
        create_speculator(cfg, sched.kv, frozenset(), V, None)

    class Wide(FakeDraft):
        vocab_size = V + 1

    with pytest.raises(ValueError, match=r"draft model's vocabulary \(65\) differs from the model's \(64\)"):
        create_speculator(cfg, sched.kv, frozenset(), V, Wide(64, "hash"))
