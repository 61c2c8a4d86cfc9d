"""Scheduler with a fake runner (no model): what it schedules, and that outputs never depend on it.

The fake runner keeps a fake KV pool holding each slot's token id (poisoned to -1 when the slot is freed).
The next token after position p is a function of the tokens at positions 0..p read through the request's
table row, so a wrong slot, a stale row or a freed slot changes (or breaks) the output. Every test compares
outputs with `reference()`, the same function applied to plain lists, and checks the slot invariant
(strict) after every step and at the end.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from runtime.config import make_config
from runtime.executor.memory import ReqToTokenTable, SlotAllocator
from runtime.messages import AbortReq, FlushCacheReq, GetInternalStateReq, TokenizedGenerateReq
from runtime.sampling.params import SamplingParams
from runtime.scheduler import Scheduler

V = 64


def next_token(seq: list[int] | torch.Tensor, mode: str) -> int:
    if mode == "inc":
        return (int(seq[-1]) + 1) % V
    t = torch.as_tensor(seq, dtype=torch.int64)
    w = torch.arange(1, t.numel() + 1, dtype=torch.int64)
    return int((t * w).sum() * 2654435761 % 1000003) % V


def reference(prompt: list[int], max_new: int, mode: str = "hash", eos: frozenset[int] = frozenset()) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_new):
        t = next_token(seq, mode)
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


class PoisonAllocator(SlotAllocator):
    def __init__(self, num_slots: int, runner_kv: torch.Tensor) -> None:
        super().__init__(num_slots, 1, strict=True)
        self.kv = runner_kv

    def free(self, slots: torch.Tensor) -> None:
        super().free(slots)
        self.kv[slots.to(torch.int64)] = -1


class FakeRunner:
    vocab_size = V

    def __init__(self, table: ReqToTokenTable, num_slots: int, mode: str) -> None:
        self.kv = torch.full((num_slots,), -1, dtype=torch.int64)
        self.table = table
        self.mode = mode
        self.calls: list = []

    def forward(self, fb):
        self.calls.append(fb)
        self.kv[fb.out_cache_loc] = fb.input_ids
        owner = [b for b, e in enumerate(fb.extend_lens) for _ in range(e)]
        logits = torch.zeros(len(fb.logits_indices), V)
        for k, idx in enumerate(fb.logits_indices.tolist()):
            b, pos = owner[idx], int(fb.positions[idx])
            slots = self.table.table[int(fb.req_pool_indices[b]), : pos + 1].to(torch.int64)
            toks = self.kv[slots]
            assert bool((toks >= 0).all()), f"read a freed or unwritten slot at position {pos}"
            logits[k, next_token(toks, self.mode)] = 10.0
        return logits


def make(num_slots: int = 512, max_running: int = 8, mode: str = "hash", eos=frozenset(), decode_fn=None,
         grammar_backend=None, max_context: int = 256, **cfg):
    table = ReqToTokenTable(max_running, max_context)
    runner = FakeRunner(table, num_slots, mode)
    alloc = PoisonAllocator(num_slots, runner.kv)
    config = make_config(max_total_tokens=num_slots, max_running_requests=max_running,
                         strict_memory_check=True, **cfg)
    sched = Scheduler(runner, alloc, table, config, frozenset(eos), decode_fn, grammar_backend)
    # Per step: (no extend rows, then the extend rows' rids, cached_len and extend_len); `steps` keeps whole
    # batches as (num_decode, rids, cached_len, extend_len) over every row.
    batches: list[tuple[bool, list[str], list[int], list[int]]] = []
    steps: list[tuple[int, list[str], list[int], list[int]]] = []
    orig = sched._schedule

    def recording():
        b = orig()
        if b is not None:
            rows = [(r.rid, r.cached_len, r.extend_len) for r in b.reqs]
            steps.append((b.num_decode, *map(list, zip(*rows, strict=True))))
            ext = rows[b.num_decode :]
            batches.append((not ext, [x[0] for x in ext], [x[1] for x in ext], [x[2] for x in ext]))
        return b

    sched._schedule = recording
    sched.batches = batches
    sched.steps = steps
    return sched, runner


def gen(rid: str, prompt: list[int], max_new: int = 8, **kw) -> TokenizedGenerateReq:
    logprob = {k: kw.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num") if k in kw}
    return TokenizedGenerateReq(rid=rid, input_ids=prompt,
                                sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw),
                                **logprob)


class Results(dict):
    def ids(self, rid: str) -> list[int]:
        return [t for o in self[rid] for t in o.new_ids]

    def final(self, rid: str):
        return self[rid][-1]


def step(sched, res: Results) -> None:
    for o in sched.step():
        res.setdefault(o.rid, []).append(o)
    sched.check_memory(strict=True)


def drain(sched, res: Results | None = None, max_steps: int = 2000) -> Results:
    res = Results() if res is None else res
    for _ in range(max_steps):
        if not sched.has_work():
            break
        step(sched, res)
    assert not sched.has_work(), "scheduler did not finish"
    step(sched, res)  # an idle step runs the idle memory check
    st = sched.internal_state()
    assert st["kv_locked_slots"] == 0
    assert st["kv_free_slots"] + st["kv_evictable_slots"] == st["max_total_num_tokens"]
    if sched.kv.tree is not None:
        sched.kv.tree.check_integrity()
    return res


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("disable", [False, True])
def test_outputs_match_reference_and_prefix_hits(disable):
    sched, _ = make(disable_radix_cache=disable)
    shared = prompt(40)
    prompts = {"a": shared + prompt(5, 1), "b": prompt(12, 2), "c": shared + prompt(7, 3)}
    for rid, p in prompts.items():
        sched.handle(gen(rid, p, 10))
    res = drain(sched)
    for rid, p in prompts.items():
        assert res.ids(rid) == reference(p, 10)
        assert res.final(rid).finish_reason == {"type": "length", "length": 10}
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
        sched, _ = make(schedule_policy=policy, chunked_prefill_size=-1, max_prefill_tokens=30)
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
    sched, _ = make(chunked_prefill_size=32)
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
    sched, _ = make(chunked_prefill_size=32)
    sched.handle(gen("long", prompt(70, 1), 3))
    sched.handle(gen("short", prompt(10, 2), 3))
    res = drain(sched)
    assert res.ids("long") == reference(prompt(70, 1), 3)
    assert res.ids("short") == reference(prompt(10, 2), 3)
    assert all(sum(e) <= 32 for dec, _, _, e in sched.batches if not dec)


# ---------------------------------------------------------------------------------------------- memory pressure
def test_admission_reserves_room_for_running_requests():
    sched, _ = make(num_slots=100)
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
    sched, _ = make(num_slots=150, schedule_conservativeness=0.05, disable_radix_cache=disable)
    for rid, p in prompts.items():
        sched.handle(gen(rid, p, 60))
    res = drain(sched)
    assert sched.internal_state()["num_retracted_reqs"] > 0
    assert any(res.final(r).num_retractions for r in prompts)
    for rid, p in prompts.items():
        assert res.ids(rid) == reference(p, 60)
        assert res.final(rid).finish_reason["type"] == "length"


def test_request_larger_than_the_pool_is_aborted_not_crashed():
    sched, _ = make(num_slots=32)
    sched.handle(gen("big", prompt(40), 4))
    sched.handle(gen("ok", prompt(8), 4))
    res = drain(sched)
    assert res.final("big").finish_reason["type"] == "abort"
    assert res.ids("ok") == reference(prompt(8), 4)


# ---------------------------------------------------------------------------------------------- abort
def test_abort_in_waiting_queue_by_rid_prefix():
    sched, _ = make(max_running=1)
    sched.handle(gen("a", prompt(10, 1), 20))
    for i in range(2):
        sched.handle(gen(f"x_{i}", prompt(10, 2), 20))
    sched.handle(gen("y", prompt(10, 3), 5))
    res = Results()
    step(sched, res)
    sched.handle(AbortReq(rid="x"))
    res = drain(sched, res)
    for rid in ("x_0", "x_1"):
        assert res.final(rid).finish_reason == {"type": "abort", "message": "aborted by client"}
        assert res.ids(rid) == []
    assert res.ids("a") == reference(prompt(10, 1), 20) and res.ids("y") == reference(prompt(10, 3), 5)


def test_abort_mid_chunk_frees_and_caches_the_partial_prefix():
    sched, _ = make(chunked_prefill_size=16)
    p = prompt(64, 7)
    sched.handle(gen("long", p, 4))
    res = Results()
    step(sched, res)
    step(sched, res)
    assert sched.chunked is not None
    sched.handle(AbortReq(rid="long"))
    assert sched.chunked is None
    res = drain(sched, res)
    assert res.final("long").finish_reason["type"] == "abort"
    assert sched.kv.tree.match_prefix(p, record=False).length == 32  # computed chunks stay cached


def test_abort_while_decoding_and_abort_all():
    sched, _ = make()
    sched.handle(gen("a", prompt(10, 1), 50))
    sched.handle(gen("b", prompt(10, 2), 50))
    sched.handle(gen("c", prompt(10, 3), 4))  # finishes before the abort_all
    res = Results()
    for _ in range(4):
        step(sched, res)
    sched.handle(AbortReq(rid="a"))
    step(sched, res)
    assert res.final("a").finish_reason["type"] == "abort"
    n_a = len(res.ids("a"))
    assert 0 < n_a < 50 and res.ids("a") == reference(prompt(10, 1), n_a)
    sched.handle(AbortReq(abort_all=True, message="shutdown"))
    res = drain(sched, res)
    assert res.final("b").finish_reason == {"type": "abort", "message": "shutdown"}
    assert res.ids("c") == reference(prompt(10, 3), 4)


# ---------------------------------------------------------------------------------------------- sharing
def test_n_copies_share_one_prefill():
    sched, _ = make()
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
    sched, _ = make()
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
    sched, _ = make(mode="inc", eos={7}, decode_fn=letters)
    sched.handle(gen("str", [40], 20, stop=["zzz", "rst"]))  # outputs 41.. -> "pqrst"
    sched.handle(gen("tok", [0], 20, stop_token_ids=[5]))
    sched.handle(gen("eos", [2], 20))
    sched.handle(gen("ign", [2], 8, ignore_eos=True))
    sched.handle(gen("min", [2], 20, min_new_tokens=10))
    res = drain(sched)
    assert res.final("str").finish_reason == {"type": "stop", "matched": "rst"}
    assert res.final("str").stop_trim == "rst" and letters(res.ids("str")).endswith("rst")
    assert res.ids("str") == [41, 42, 43, 44, 45]
    assert res.final("tok").finish_reason == {"type": "stop", "matched": 5} and res.ids("tok") == [1, 2, 3, 4, 5]
    assert res.final("eos").finish_reason == {"type": "stop", "matched": 7} and res.ids("eos") == [3, 4, 5, 6, 7]
    assert res.final("ign").finish_reason["type"] == "length" and res.ids("ign") == list(range(3, 11))
    assert len(res.ids("min")) >= 10 and 7 not in res.ids("min")[:9]


def test_max_new_tokens_zero_and_prompt_logprobs_cap_the_prefix():
    sched, _ = make(mode="inc")
    p = [0, 1, 2, 3, 9, 10, 11]
    sched.handle(gen("warm", p, 2))
    drain(sched)
    sched.handle(gen("lp", p, 0, return_logprob=True, logprob_start_len=0, top_logprobs_num=2))
    sched.handle(gen("lp3", p, 0, return_logprob=True, logprob_start_len=3))
    res = drain(sched)
    out = res.final("lp")
    assert out.finish_reason == {"type": "length", "length": 0} and out.new_ids == []
    assert out.cached_tokens == 0  # capped so every prompt position is computed
    assert [t for _, t in out.input_logprobs] == p and out.input_logprobs[0][0] is None
    lps = [lp for lp, _ in out.input_logprobs[1:]]
    assert [lp > -0.1 for lp in lps] == [True, True, True, False, True, True]
    assert out.input_top_logprobs[0] is None and out.input_top_logprobs[1][0][1] == 1
    out3 = res.final("lp3")
    assert out3.cached_tokens == 2 and [t for _, t in out3.input_logprobs] == p[3:]


def test_prompt_logprobs_across_chunks_and_output_logprobs():
    sched, _ = make(mode="inc", chunked_prefill_size=8)
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
    sched, _ = make()
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


class OnlyToken:
    """A grammar that allows one token id, and terminates after `n` accepted tokens."""

    def __init__(self, tok: int, n: int) -> None:
        self.tok, self.n, self.seen = tok, n, 0

    def copy(self) -> OnlyToken:
        return OnlyToken(self.tok, self.n)

    def fill_mask(self, row: torch.Tensor) -> None:
        row.fill_(False)
        row[self.tok] = True

    def write_bitmask(self, row: torch.Tensor) -> None:  # packed int32 [ceil(V / 32)]: the scheduler's mask path
        row.zero_()
        row[self.tok >> 5] = 1 << (self.tok & 31)

    def accept_token(self, tok: int) -> None:
        assert tok == self.tok
        self.seen += 1

    def is_terminated(self) -> bool:
        return self.seen >= self.n


class FakeGrammars:
    def __init__(self) -> None:
        self.futures: list[Future] = []

    def get_future(self, params):
        fut: Future = Future()
        self.futures.append(fut)
        return fut


def test_grammar_queue_and_mask():
    backend = FakeGrammars()
    sched, _ = make(grammar_backend=backend)
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
    assert res.ids("g") == [9, 9, 9] and res.final("g").finish_reason == {"type": "stop", "matched": None}
    assert res.final("bad").finish_reason["type"] == "abort" and "bad regex" in res.final("bad").finish_reason["message"]
    assert res.ids("plain") == reference(prompt(6), 3)
