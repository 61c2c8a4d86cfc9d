"""A scheduler on a fake runner, for tests (in the style of vLLM's `create_scheduler`).

The fake runner keeps a fake KV pool holding each slot's token id (poisoned to -1 when the slot is freed).
The next token after position p is a function of the tokens at positions 0..p read through the request's
table row, so a wrong slot, a stale row or a freed slot changes (or breaks) the output. `reference()` is the
same function applied to plain lists; `drain()` steps until idle and checks the slot invariant (strict)
after every step and at the end.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from runtime.config import make_config
from runtime.constrained.seam import BaseGrammarBackend, Grammar
from runtime.executor.memory import ReqToTokenTable, SlotAllocator
from runtime.messages import TokenizedGenerateReq
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


def create_scheduler(num_slots: int = 512, max_running: int = 8, mode: str = "hash", eos=frozenset(), decode_fn=None,
         grammar_backend=None, max_context: int = 256, token_bytes_fn=None, **cfg):
    table = ReqToTokenTable(max_running, max_context)
    runner = FakeRunner(table, num_slots, mode)
    alloc = PoisonAllocator(num_slots, runner.kv)
    config = make_config(max_total_tokens=num_slots, max_running_requests=max_running,
                         strict_memory_check=True, **cfg)
    sched = Scheduler(runner, alloc, table, config, frozenset(eos), decode_fn, grammar_backend,
                      token_bytes_fn=token_bytes_fn)
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


def inject_fault(sched: Scheduler, rid: str, at_token: int) -> None:
    """A failpoint: output token `at_token` of request `rid` raises after it is appended (a bug anywhere in that
    request's processing looks like this), on the one path every sampled or accepted draft token takes."""
    proc = sched.processor
    append = proc.append_token

    def faulty(req, tok, lp_row, jump=True):  # noqa: ANN001, ANN202
        if req.rid == rid and len(req.output_ids) + 1 >= at_token:
            req.output_ids.append(tok)
            raise RuntimeError(f"injected fault at token {len(req.output_ids)}")
        append(req, tok, lp_row, jump)

    proc.append_token = faulty


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


class FakeGrammar(Grammar):
    """Base of the test grammars over the fake vocabulary: a subclass says which tokens it `allows` and writes
    its bitmask; the accepted tokens are kept in `seen`, so rollback is exact. No jump-forward."""

    vocab_size = V

    def __init__(self) -> None:
        self.seen: list[int] = []

    @property
    def num_accepted(self) -> int:
        return len(self.seen)

    def allows(self, tok: int) -> bool:
        return True

    def accept_token(self, tok: int) -> None:
        if not self.allows(tok):
            raise ValueError(f"token {tok} is not allowed")
        self.seen.append(tok)

    def rollback(self, n: int) -> None:
        if n > len(self.seen):
            raise ValueError(f"cannot roll back {n} tokens")
        del self.seen[len(self.seen) - n:]

    def is_terminated(self) -> bool:
        return False

    def can_accept_after_rollback(self, n: int, token_ids) -> bool:  # noqa: ANN001
        return n <= len(self.seen) and all(self.allows(t) for t in token_ids)

    def jump_forward(self) -> str | None:
        return None


class OnlyToken(FakeGrammar):
    """A grammar that allows one token id, and terminates after `n` accepted tokens."""

    def __init__(self, tok: int, n: int) -> None:
        super().__init__()
        self.tok, self.n = tok, n

    def copy(self) -> OnlyToken:
        return OnlyToken(self.tok, self.n)

    def allows(self, tok: int) -> bool:
        return tok == self.tok

    def write_bitmask(self, row: torch.Tensor) -> None:  # packed int32 [ceil(V / 32)]: the scheduler's mask path
        row.zero_()
        row[self.tok >> 5] = 1 << (self.tok & 31)

    def is_terminated(self) -> bool:
        return len(self.seen) >= self.n


class FakeGrammars(BaseGrammarBackend):
    """Compiles resolved by the test: `futures[i]` is the i-th constrained request's."""

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def get_future(self, params):
        fut: Future = Future()
        self.futures.append(fut)
        return fut
