"""Speculative decoding in the scheduler: drafts ride on decode rows, one extend verifies them.

Data flow of one step (`--speculative-algorithm ngram|draft`):
1. `attach` (after decode planning and any retraction): the decode rows whose requests may speculate go to
   the proposer in one call (runtime/scheduler/proposer.py: n-gram lookup, or the draft model of
   runtime/scheduler/draft.py, k forwards batched over them); each proposal is cut before the first stop id
   and, for a constrained request, at the first token its grammar rejects. Its row becomes a verify row, an
   extend row computing [last token, d_1..d_k] over the request's cached KV (extend_len = 1 + k, a logit at
   every position); the k extra slots come from the allocator (evicting unlocked cache leaves if needed) and
   are written into the request's table row right after its decode slot. No slot of a draft enters the tree.
2. The model runs the step (mixed with prefill and plain decode rows; a step with a verify row is not an
   all-decode batch, so it runs eagerly, never through compiled/CUDA-graph decode).
3. `verify` (from the ResultProcessor): the rows' logits are processed exactly as plain sampling would
   process them at those positions (penalties over output + accepted drafts, min_new_tokens, logit bias,
   the grammar mask of the state after the drafts), then the rule of runtime/speculative/verify.py picks
   the emitted tokens. They are appended one by one through the processor's normal path (logprobs of the
   target model, grammar advance, finish checks: EOS, stop strings, max_new_tokens), stopping at a finish.
   Then the row keeps the KV of the last token and of the emitted drafts but one (the KV lags the tokens
   by one, as after any decode) and frees the rest at once (`KVManager.trim`); the proposer settles (the
   draft model keeps its K/V of the accepted drafts only). A proposal that is not verified (no slots) is
   settled at once. A request leaving the pool releases its proposer state too (KVManager.on_release).

Adaptive pause (`pause_after_verify`, --speculative-min-accept / --speculative-pause-steps): each verify step
folds its accepted-draft count into the request's moving average; below the minimum the request sits out the
next pause_steps decode steps as a plain decode row (the same path as a request with no n-gram match), then
proposes again. A pause that follows another with no recovery in between doubles, up to 8x.

Invariant after `verify`: draft_ids == [], extend_len == 0, cached_len == fill_len - 1 (or the request is
finished), and every slot of the row past cached_len is back in the allocator: a verify step never leaves
anything behind, so abort, retraction and finish see the same state as after a plain decode step.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from runtime.config import Config, SpeculativeConfig
from runtime.constrained.grammar import unpack_bitmask
from runtime.constrained.seam import Grammar
from runtime.executor.staging import to_device
from runtime.messages import FinishAbort
from runtime.sampling import SamplingInfo, compute_logprobs, greedy_ids, process_logits, target_probs
from runtime.scheduler.cache import KVManager
from runtime.scheduler.core import Req
from runtime.scheduler.decode import DecodePlan
from runtime.scheduler.draft import DraftProposer, DraftRunner
from runtime.scheduler.proposer import NgramProposer, Proposal, Proposer
from runtime.speculative import accept_greedy, accept_sampled, spec_uniforms

log = logging.getLogger(__name__)


def speculation_on(cfg: SpeculativeConfig) -> bool:
    algo = cfg.speculative_algorithm
    return algo is not None and algo.lower() != "none"


def create_speculator(cfg: Config, kv: KVManager, eos_ids: frozenset[int], vocab_size: int,
                      draft_runner: DraftRunner | None) -> Speculator:
    """The Speculator with the configured proposer (draft: over `draft_runner`, its own pool and table)."""
    sp = cfg.speculative
    if (sp.speculative_algorithm or "").lower() != "draft":
        return Speculator(sp, kv, eos_ids, vocab_size, NgramProposer(sp), cfg.grammar.json_close_reserve)
    if draft_runner is None:
        raise ValueError("--speculative-algorithm draft: no draft model runner was given to the scheduler")
    if draft_runner.vocab_size != vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_runner.vocab_size}) differs from the model's "
                         f"({vocab_size})")
    return Speculator(sp, kv, eos_ids, vocab_size, DraftProposer(draft_runner, eos_ids, cfg.model.random_seed),
                      cfg.grammar.json_close_reserve)


PAUSE_AVG_WEIGHT = 0.5  # weight of the newest verify step in Req.spec.accept_avg
PAUSE_MAX_FACTOR = 8  # consecutive pauses double up to this many times --speculative-pause-steps


def pause_after_verify(req: Req, accepted: int, min_accept: float, pause_steps: int) -> bool:
    """Fold one verify step's `accepted` drafts into req.spec.accept_avg (req.spec.verify_ct already counts
    the step; its first step sets the average). Average below `min_accept` (> 0): pause for `pause_steps`
    decode steps, or twice the previous pause (at most PAUSE_MAX_FACTOR x) when the average has not recovered
    since it; returns True. Otherwise the next pause starts again at `pause_steps`."""
    w = PAUSE_AVG_WEIGHT
    first = req.spec.verify_ct == 1
    req.spec.accept_avg = float(accepted) if first else w * accepted + (1 - w) * req.spec.accept_avg
    if min_accept > 0 and req.spec.accept_avg < min_accept:
        prev = req.spec.pause_len
        req.spec.pause_len = min(2 * prev, PAUSE_MAX_FACTOR * pause_steps) if prev else pause_steps
        req.spec.pause = req.spec.pause_len
        return True
    req.spec.pause_len = 0
    return False



class TokenSink(Protocol):
    """Where a verify step's emitted tokens go: the ResultProcessor (runtime/scheduler/output.py)."""

    default_seed: int  # the seed of requests without their own (--random-seed)

    def append_token(self, req: Req, tok: int, lp_row: torch.Tensor | None, jump: bool = True) -> None:
        """Append `tok` to `req` as a sampled token (logprobs from `lp_row` [V]), advance its grammar, check
        finishes, jump forward only where `jump`. The token is appended before anything can raise; raising
        aborts `req` only."""
        ...

class Speculator:
    """Proposes drafts for decode rows and verifies them after the forward; counts what it did."""

    def __init__(self, cfg: SpeculativeConfig, kv: KVManager, eos_ids: frozenset[int], vocab_size: int,
                 proposer: Proposer | None = None, close_reserve: int = 0) -> None:
        self.k = cfg.speculative_num_draft_tokens
        self.close_reserve = close_reserve  # --json-close-reserve: JSON requests' closing window is not drafted
        self.min_accept = cfg.speculative_min_accept
        self.pause_steps = cfg.speculative_pause_steps
        self.proposer: Proposer = proposer if proposer is not None else NgramProposer(cfg)
        self.kv = kv
        kv.on_release.append(self.proposer.release)
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.stats = {"spec_verify_ct": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                      "spec_emitted_tokens": 0, "spec_pauses": 0, "spec_paused_steps": 0}

    # ---- before the forward -----------------------------------------------------------------------------------
    def attach(self, dplan: DecodePlan) -> DecodePlan:
        """Turn the decode rows that get drafts into verify rows; returns the new plan (same requests)."""
        nd = len(dplan.decode)
        asks: list[tuple[Req, int]] = []
        for req in dplan.decode:
            if req.spec.pause > 0:  # a paused request decodes plainly; this step counts off its pause
                req.spec.pause -= 1
                self.stats["spec_paused_steps"] += 1
            elif (k := self._budget(req)) > 0:
                asks.append((req, k))
        proposals = self.proposer.propose([r for r, _ in asks], [k for _, k in asks]) if asks else []
        got = {id(r): p for (r, _), p in zip(asks, proposals, strict=True)}
        keep: list[tuple[Req, torch.Tensor]] = []
        verify: list[tuple[Req, torch.Tensor]] = []
        for req, slot in zip(dplan.decode, dplan.slots[:nd], strict=True):
            prop = got.get(id(req))
            drafts, q = self._cut(req, prop) if prop is not None else ([], None)
            extra = self.kv.alloc(len(drafts)) if drafts else None
            if extra is None:
                req.spec.draft_bitmask = None
                if prop is not None:
                    self.proposer.settle(req)
                keep.append((req, slot))
                continue
            # row positions: cached_len = last token (slot), cached_len + i = draft d_i (extra[i - 1])
            self.kv.table.write(req.row_index, req.cached_len + 1, extra)
            req.spec.draft_ids, req.spec.draft_q = drafts, q
            req.extend_len = 1 + len(drafts)
            verify.append((req, torch.cat([slot, extra])))
        if not verify:
            return dplan
        slots = [s for _, s in keep] + list(dplan.slots[nd:]) + [s for _, s in verify]
        return DecodePlan([r for r, _ in keep], dplan.extend + [r for r, _ in verify], slots,
                          dplan.retracted, dplan.aborted)

    def _budget(self, req: Req) -> int:
        """How many tokens `req` may have proposed this step (0: it does not speculate)."""
        if req.sampling_params.disable_speculation:
            return 0
        if req.closes_within(self.close_reserve, ahead=self.k):
            return 0  # its last tokens are sampled one by one in the closing window (constrained/closing.py)
        return min(self.k, req.remaining_new_tokens)

    def _cut(self, req: Req, prop: Proposal) -> tuple[list[int], torch.Tensor | None]:
        """The proposal cut before a stop id and at the first token the grammar rejects; q cut alike."""
        drafts, p = prop.tokens, req.sampling_params
        if not p.ignore_eos:  # a stop id ends the request: never worth proposing past, nor proposing it
            stops = self.eos_ids | set(p.stop_token_ids)
            for i, t in enumerate(drafts):
                if t in stops:
                    drafts = drafts[:i]
                    break
        if drafts and req.grammar is not None:
            drafts = self._check_grammar(req, req.grammar, drafts)
        return drafts, (prop.q[: len(drafts)] if prop.q is not None and drafts else None)

    def _check_grammar(self, req: Req, g: Grammar, drafts: list[int]) -> list[int]:
        """Cut `drafts` at the first token the grammar rejects; keep the allowed-token bitmask of the state
        before each verify position (row i: after d_1..d_i) in req.spec.draft_bitmask [len + 1, W]."""
        bm = torch.zeros((len(drafts) + 1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        g.write_bitmask(bm[0])
        ok = 0
        try:
            for d in drafts:
                try:
                    g.accept_token(d)
                except ValueError:
                    break
                ok += 1
                g.write_bitmask(bm[ok])
        finally:
            g.rollback(ok)
        req.spec.draft_bitmask = bm[: ok + 1] if ok else None
        return drafts[:ok]

    # ---- after the forward ------------------------------------------------------------------------------------
    def verify(self, proc: TokenSink, rows: list[tuple[Req, int]], logits: torch.Tensor) -> None:
        """rows: (request, its first logits row); request r owns logits rows [start, start + k_r + 1).
        `proc` appends one token the normal way (the ResultProcessor)."""
        reqs = [r for r, _ in rows]
        ks = [len(r.spec.draft_ids) for r in reqs]
        flat = [start + i for (_, start), k in zip(rows, ks, strict=True) for i in range(k + 1)]
        first = np.cumsum([0] + [k + 1 for k in ks])[:-1].tolist()  # flat row of each request's position 0
        lg = logits[to_device(flat, torch.int64, logits.device)]
        info = self._info(reqs, ks, proc.default_seed, lg.device)
        processed = process_logits(lg, info, self._allowed(reqs, ks, lg))
        argmax = greedy_ids(processed).tolist()
        sampled = [i for i, g in enumerate(info.greedy_rows) if not g]
        probs = target_probs(processed, info, sampled) if sampled else None
        where = {row: j for j, row in enumerate(sampled)}  # flat row -> row of `probs`
        lp_rows = [i for r, k, f in zip(reqs, ks, first, strict=True) if r.logprobs.wanted for i in range(f, f + k + 1)]
        lp = compute_logprobs(lg[to_device(lp_rows, torch.int64, lg.device)]) if lp_rows else None
        lp_at = {row: j for j, row in enumerate(lp_rows)}
        for req, k, f in zip(reqs, ks, first, strict=True):
            drafts = req.spec.draft_ids
            if info.greedy_rows[f]:
                toks = accept_greedy(argmax[f : f + k + 1], drafts)
            else:
                assert probs is not None
                p = probs[where[f] : where[f] + k + 1]
                us = [spec_uniforms(req.seed, len(req.output_ids) + i) for i in range(k + 1)]
                toks = accept_sampled(p, drafts, us, req.spec.draft_q)
            self._emit(proc, req, toks, [lp[lp_at[f + i]] if lp is not None and req.logprobs.wanted else None
                                         for i in range(len(toks))], k)

    def _emit(self, proc: TokenSink, req: Req, toks: list[int], lp_rows: list[torch.Tensor | None], k: int) -> None:
        """Append `toks` (all but the last are accepted drafts) until a finish; then free the row's extra KV."""
        old_cached, n = req.cached_len, 0
        try:
            for i, t in enumerate(toks):
                n += 1  # `append_token` appends before anything in it can raise
                proc.append_token(req, t, lp_rows[i], jump=i == len(toks) - 1)
                if req.finished:
                    break
        except Exception as e:  # an error in one request's processing aborts that request only
            log.exception("internal error while processing request %s", req.rid)
            req.finish_reason = FinishAbort(message=f"internal error while processing request: {type(e).__name__}: {e}")
        finally:
            req.spec.draft_ids, req.spec.draft_bitmask, req.spec.draft_q = [], None, None
            self.kv.trim(req, old_cached + n)
            self.proposer.settle(req)
        accepted = min(n, len(toks) - 1)
        req.spec.verify_ct += 1
        req.spec.accepted += accepted
        req.spec.drafted += k
        s = self.stats
        s["spec_pauses"] += pause_after_verify(req, accepted, self.min_accept, self.pause_steps)
        s["spec_verify_ct"] += 1
        s["spec_draft_tokens"] += k
        s["spec_accepted_tokens"] += accepted
        s["spec_emitted_tokens"] += n

    def _info(self, reqs: list[Req], ks: list[int], default_seed: int, device: torch.device) -> SamplingInfo:
        """Sampling tensors for every verify position: position i of request r samples output token
        len(output_ids) + i after output_ids + d_1..d_i (what plain decoding would see there)."""
        params, outs, steps, stops, seeds = [], [], [], [], []
        for req, k in zip(reqs, ks, strict=True):
            p = req.sampling_params
            stop = [] if p.ignore_eos else sorted(self.eos_ids | set(p.stop_token_ids))
            for i in range(k + 1):
                params.append(p)
                outs.append(req.output_ids + req.spec.draft_ids[:i])
                steps.append(len(req.output_ids) + i)
                stops.append(stop)
                seeds.append(req.seed)
        return SamplingInfo.build(params=params, output_ids=outs, steps=steps, vocab_size=self.vocab_size,
                                  stop_ids=stops, default_seed=default_seed, device=device, seeds=seeds)

    def _allowed(self, reqs: list[Req], ks: list[int], lg: torch.Tensor) -> torch.Tensor | None:
        """bool [R, V] allowed tokens per verify position (grammar rows only), or None without grammars."""
        if all(r.spec.draft_bitmask is None for r in reqs):
            return None
        V = lg.shape[1]
        allowed = torch.ones(lg.shape, dtype=torch.bool, device=lg.device)
        f = 0
        for req, k in zip(reqs, ks, strict=True):
            if req.spec.draft_bitmask is not None:
                allowed[f : f + k + 1] = unpack_bitmask(req.spec.draft_bitmask, V).to(lg.device)
            f += k + 1
        return allowed
