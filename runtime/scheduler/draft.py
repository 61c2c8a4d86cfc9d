"""The draft-model proposer: a smaller model with the target's tokenizer guesses k tokens per request.

The draft model has its own KV pool, slot allocator and request-to-token table (a second ModelRunner in the
scheduler process; tests pass a fake). No radix tree: each speculating request gets a draft table row on its
first proposal and keeps it until it leaves the target's pool (finish, abort, retraction: `release`).

Per request, `DraftRow.kv_len` = n means positions [0, n) of the request's fill_ids have draft K/V at slots
table[row, :n], all owned by the request. One step (`propose`, batched over the speculating requests):
1. catch-up + d_1: one forward computes fill_ids[kv_len : fill_len] (usually 1 or 2 tokens; the whole
   prompt on the first proposal or after a retraction, the tokens decoded plainly during a speculation pause)
   and picks d_1 from the logits of its last position;
2. k - 1 decode forwards: d_{j-1} at position fill_len + j - 2 -> d_j.
So after proposing m tokens the row holds fill_len + m - 1 positions (d_1..d_{m-1} past fill_len; d_m has no
K/V). `settle`, once the verify row emitted its tokens, keeps the positions whose token the request really has
(the accepted prefix of the drafts) and frees the rest at once: the draft's cache then holds exactly the
request's accepted tokens, and the next catch-up computes what it lacks (the bonus token, and d_m when all
were accepted).

Choosing d_j: the draft's logits get the request's own processing at that position (penalties over output +
d_1..d_{j-1}, min_new_tokens, logit bias, its grammar's mask of the state after d_1..d_{j-1}) and its stop ids
removed (proposing a stop is never worth it). Greedy requests take the argmax; sampled requests draw d_j from
q_j = the processed distribution after temperature/top-k/top-p/min-p (a uniform from (seed, step) only), and
q_j goes with the proposal so the verify rule is exact. A position where nothing is allowed ends the proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.constrained.grammar import unpack_bitmask
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.memory import ReqToTokenTable, SlotAllocator
from runtime.sampling import SamplingInfo, greedy_ids, process_logits, target_probs
from runtime.scheduler.core import Req
from runtime.scheduler.proposer import NO_PROPOSAL, Proposal
from runtime.speculative import draft_uniform, inverse_cdf


class DraftRunner(Protocol):
    """What the proposer needs of the draft model: a runner and its own pool."""

    vocab_size: int
    allocator: SlotAllocator
    req_to_token: ReqToTokenTable

    def forward(self, fb: ForwardBatch) -> torch.Tensor: ...


@dataclass
class DraftRow:
    """A request's draft KV: positions [0, kv_len) of its fill_ids at table[row, :kv_len]. While a proposal is
    unsettled, `base` is the fill_len it was made at and `drafts` the proposed tokens (positions base.. hold
    their K/V up to kv_len)."""

    row: int
    kv_len: int = 0
    base: int = -1
    drafts: list[int] = field(default_factory=list)


@dataclass
class _Active:
    """One request while its proposal is built: its index in the call, its row, its budget k, the tokens
    chosen so far, their q rows (sampled requests) and the grammar tokens to roll back."""

    i: int
    req: Req
    st: DraftRow
    k: int
    tokens: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    advanced: int = 0


class DraftProposer:
    def __init__(self, runner: DraftRunner, eos_ids: frozenset[int], default_seed: int) -> None:
        self.runner = runner
        self.alloc = runner.allocator
        self.table = runner.req_to_token
        self.vocab_size = runner.vocab_size
        self.eos_ids = eos_ids
        self.default_seed = default_seed
        self.rows: dict[int, tuple[Req, DraftRow]] = {}  # id(req) -> (req, its draft row)
        self._all: list[_Active] = []  # the requests of the current `propose` call
        self._logits = torch.empty(0)  # the last draft forward's logits [rows of that forward, V]

    # ---- the proposer seam ------------------------------------------------------------------------------------
    def propose(self, reqs: list[Req], ks: list[int]) -> list[Proposal]:
        out = [NO_PROPOSAL] * len(reqs)
        act = self._catch_up(reqs, ks)
        try:
            for j in range(1, max((a.k for a in act), default=0) + 1):
                if j > 1:
                    act = self._decode([a for a in act if a.k >= j])
                if not act:
                    break
                self._choose(act, j)
                act = [a for a in act if len(a.tokens) == j]  # a row with nothing allowed stopped
        finally:
            for a in self._all:
                if a.advanced and a.req.grammar is not None:
                    a.req.grammar.rollback(a.advanced)
                a.st.drafts = list(a.tokens)
                q = torch.stack(a.qs) if a.qs and len(a.qs) == len(a.tokens) else None
                out[a.i] = Proposal(list(a.tokens), q)
        return out

    def settle(self, req: Req) -> None:
        """Keep the draft K/V of the positions whose proposed token the request now has; free the rest."""
        held = self.rows.get(id(req))
        if held is None or held[1].base < 0:
            return
        st = held[1]
        have = req.token_slice(st.base, min(st.kv_len, req.fill_len))
        c = 0
        while c < len(have) and c < len(st.drafts) and have[c] == st.drafts[c]:
            c += 1
        self._shrink(st, st.base + c)
        st.base, st.drafts = -1, []

    def release(self, req: Req) -> None:
        held = self.rows.pop(id(req), None)
        if held is not None:
            st = held[1]
            self._shrink(st, 0)
            self.table.free_row(st.row)

    def check(self, live: list[Req]) -> str | None:
        held = sum(st.kv_len for _, st in self.rows.values())
        alive = {id(r) for r in live}
        stale = [r.rid for r, _ in self.rows.values() if id(r) not in alive]
        free = self.alloc.available()
        if free + held == self.alloc.num_slots and not stale:
            return None
        return (f"draft KV pool leak: free {free} + request-held {held} != total {self.alloc.num_slots}"
                f" (rows of requests no longer running: {stale[:4]})")

    # ---- forwards -----------------------------------------------------------------------------------------------
    def _catch_up(self, reqs: list[Req], ks: list[int]) -> list[_Active]:
        """Forward 1: each request's missing positions [kv_len, fill_len); rows that need one token go first
        (decode rows). Requests for which no row, no slots or no context room is left propose nothing."""
        self._all = []
        rows: list[tuple[_Active, list[int], torch.Tensor]] = []
        for i, (req, k) in enumerate(zip(reqs, ks, strict=True)):
            k = min(k, self.table.max_context - req.fill_len + 1)
            st = self._row(req)
            if k <= 0 or st is None:
                continue
            self.settle(req)  # an earlier proposal never settled (defensive: settle normally ran)
            if st.kv_len >= req.fill_len:  # the last position is recomputed: its logits propose d_1
                self._shrink(st, req.fill_len - 1)
            ids = req.token_slice(st.kv_len, req.fill_len)
            slots = self.alloc.alloc(len(ids))
            if slots is None:
                continue
            self.table.write(st.row, st.kv_len, slots)
            a = _Active(i, req, st, k)
            st.base, st.drafts = req.fill_len, []
            rows.append((a, ids, slots))
        rows.sort(key=lambda x: len(x[1]) != 1)  # stable: decode rows first
        if not rows:
            return []
        nd = sum(len(ids) == 1 for _, ids, _ in rows)
        fb = ForwardBatch.build([ids for _, ids, _ in rows], [a.st.kv_len for a, _, _ in rows],
                                torch.cat([s for _, _, s in rows]), [a.st.row for a, _, _ in rows], num_decode=nd)
        for a, ids, _ in rows:
            a.st.kv_len += len(ids)
        self._all = [a for a, _, _ in rows]
        self._logits = self.runner.forward(fb)  # [len(rows), V]
        return self._all

    def _decode(self, act: list[_Active]) -> list[_Active]:
        """One decode forward: each row's last draft at the next position. All or nothing on the slots."""
        slots = self.alloc.alloc(len(act)) if act else None
        if slots is None:
            return []
        for a, s in zip(act, slots, strict=True):
            self.table.write(a.st.row, a.st.kv_len, s.view(1))
        fb = ForwardBatch.build([[a.tokens[-1]] for a in act], [a.st.kv_len for a in act], slots,
                                [a.st.row for a in act], num_decode=len(act))
        for a in act:
            a.st.kv_len += 1
        self._logits = self.runner.forward(fb)
        return act

    # ---- choosing the drafts -----------------------------------------------------------------------------------
    def _choose(self, act: list[_Active], j: int) -> None:
        """Pick d_j for every row of `act` from the last forward's logits (row order = `act`)."""
        info = self._info(act)
        lg = self._logits.float()
        processed = process_logits(lg, info, self._allowed(act, lg))
        alive = torch.isfinite(processed.amax(dim=-1)).tolist()
        argmax = greedy_ids(processed).tolist()
        sampled = [b for b, g in enumerate(info.greedy_rows) if not g and alive[b]]
        probs = target_probs(processed, info, sampled) if sampled else None
        where = {b: n for n, b in enumerate(sampled)}
        for b, a in enumerate(act):
            if not alive[b]:
                continue
            q = probs[where[b]] if probs is not None and b in where else None
            tok = argmax[b] if q is None else inverse_cdf(q, draft_uniform(a.req.seed, len(a.req.output_ids) + j - 1))
            if a.req.grammar is not None:
                try:
                    a.req.grammar.accept_token(tok)
                except ValueError:  # the mask allowed it, so this does not happen; stop proposing if it does
                    continue
                a.advanced += 1
            a.tokens.append(tok)
            if q is not None:
                a.qs.append(q)

    def _info(self, act: list[_Active]) -> SamplingInfo:
        """Sampling tensors of each row's next position: output token len(output_ids) + len(tokens)."""
        return SamplingInfo.build(
            params=[a.req.sampling_params for a in act], output_ids=[a.req.output_ids + a.tokens for a in act],
            steps=[len(a.req.output_ids) + len(a.tokens) for a in act], vocab_size=self.vocab_size,
            stop_ids=[self._stops(a.req) for a in act], default_seed=self.default_seed,
            device=self._logits.device, seeds=[a.req.seed for a in act])

    def _allowed(self, act: list[_Active], lg: torch.Tensor) -> torch.Tensor | None:
        """bool [R, V]: the grammar's allowed tokens (state after the drafts so far) minus the stop ids."""
        stops = [self._stops(a.req) for a in act]
        if not any(stops) and all(a.req.grammar is None for a in act):
            return None
        V = lg.shape[1]
        allowed = torch.ones(lg.shape, dtype=torch.bool)
        for b, (a, st) in enumerate(zip(act, stops, strict=True)):
            if a.req.grammar is not None:
                bm = torch.zeros((1, (V + 31) // 32), dtype=torch.int32)
                a.req.grammar.write_bitmask(bm[0])
                allowed[b] = unpack_bitmask(bm, V)[0]
            if st:
                allowed[b, [t for t in st if t < V]] = False
        return allowed.to(lg.device)

    def _stops(self, req: Req) -> list[int]:
        p = req.sampling_params
        return [] if p.ignore_eos else sorted(self.eos_ids | set(p.stop_token_ids))

    # ---- rows and slots -------------------------------------------------------------------------------------------
    def _row(self, req: Req) -> DraftRow | None:
        held = self.rows.get(id(req))
        if held is not None:
            return held[1]
        row = self.table.alloc_row()
        if row is None:
            return None
        st = DraftRow(row)
        self.rows[id(req)] = (req, st)
        return st

    def _shrink(self, st: DraftRow, keep: int) -> None:
        if keep < st.kv_len:
            self.alloc.free(self.table.read(st.row, keep, st.kv_len))
            st.kv_len = keep
