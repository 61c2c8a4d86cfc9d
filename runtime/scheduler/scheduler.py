"""The scheduler: continuous batching over a radix prefix cache (docs/architecture.md).

Input: `handle(msg)` for TokenizedGenerateReq / AbortReq / FlushCacheReq / GetInternalStateReq.
Output: `step()` runs one iteration and returns a ReqTokenOut for every request that produced tokens or
finished (aborted ones included). Queues: grammar (constraint still compiling) -> waiting -> running, plus
at most one chunked request whose prompt is computed over several steps; retraction moves running
requests back to waiting. The runner, pools and table come in through the constructor, so tests drive
the scheduler on CPU with a fake runner.

A step is one `Batch` and one forward: every running request's next token (decode rows, plus the forced
tokens of a jump-forward) and, under the step's token budget, prefill chunks of waiting requests (extend
rows). So a running request gets a token every step unless memory forces a retraction; a step in which one
does not is counted in `stall_steps` by reason. `--disable-mixed-steps` restores separated steps (prefill
first, decode only when nothing is admitted), for comparison.

Just over the 400-line soft cap: planning (decode.py, prefill.py), output (output.py) and the KV bookkeeping
(cache.py) live apart; what stays is the step and the queues every part of it touches.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from kernels import fallbacks
from runtime.config import Config, resolve
from runtime.constrained.seam import BaseGrammarBackend, CompileFuture, Grammar
from runtime.constrained.thinking import ThinkingVocab, wrap_thinking
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.memory import ReqToTokenTable, SlotAllocator
from runtime.messages import (
    AbortReq,
    FinishAbort,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateOut,
    ReqTokenOut,
    TokenizedGenerateReq,
    ToScheduler,
)
from runtime.sampling import mix_seed
from runtime.sampling.params import SamplingParams
from runtime.scheduler.core import Batch, Req
from runtime.scheduler.decode import DecodePlan, plan_decode, retract_ratio
from runtime.scheduler.draft import DraftRunner
from runtime.scheduler.hicache import HiCache
from runtime.scheduler.output import ResultProcessor
from runtime.scheduler.policy import order_waiting, preemption_victims
from runtime.scheduler.prefill import PrefillAdder, PrefillPlan, reservation
from runtime.scheduler.speculative import create_speculator, speculation_on
from runtime.scheduler.swa_cache import create_kv_manager

log = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
STALL_REASONS = ("prefill_only", "retraction", "grammar_wait", "other")
NO_DECODE = DecodePlan([], [], [], [], [])
NO_PREFILL = PrefillPlan([], [], [], [], None, [])


class Runner(Protocol):
    """What the scheduler needs of a model runner."""

    vocab_size: int

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab_size] float32."""
        ...


def _is_constrained(p: SamplingParams) -> bool:
    return any(x is not None for x in p.constraints)


class Scheduler:
    def __init__(
        self, runner: Runner, allocator: SlotAllocator, table: ReqToTokenTable, cfg: Config,
        eos_ids: frozenset[int], decode_fn: Callable[[list[int]], str] | None = None,
        grammar_backend: BaseGrammarBackend | None = None,
        encode_fn: Callable[[str], list[int]] | None = None, token_bytes_fn: Callable[[int], bytes] | None = None,
        draft_runner: DraftRunner | None = None, hicache: HiCache | None = None,
    ) -> None:
        self.cfg = cfg = resolve(cfg)
        self.runner = runner
        self.grammar_backend = grammar_backend
        self.kv = create_kv_manager(allocator, table, use_tree=not cfg.cache.disable_radix_cache, hicache=hicache)
        self.spec = (create_speculator(cfg, self.kv, frozenset(eos_ids), runner.vocab_size, draft_runner)
                     if speculation_on(cfg.speculative) else None)
        self.processor = ResultProcessor(self.kv, runner.vocab_size, frozenset(eos_ids), cfg, decode_fn,
                                         encode_fn, token_bytes_fn, self.spec)
        self.policy = cfg.scheduler.schedule_policy
        # None: priority scheduling off; else whether smaller priority values run first
        self.low_first = (cfg.scheduler.schedule_low_priority_values_first
                          if cfg.scheduler.enable_priority_scheduling else None)
        self.mixed = not cfg.scheduler.disable_mixed_steps
        self.grammar_queue: list[Req] = []
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self._outs: list[ReqTokenOut] = []
        self._arrivals = 0
        self.init_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * cfg.scheduler.schedule_conservativeness)
        self.min_ratio = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio = self.init_ratio
        self.stats = {"num_retracted_reqs": 0, "prompt_tokens": 0, "cached_tokens": 0, "forward_steps": 0,
                      "prefill_tokens": 0, "decode_tokens": 0, "jump_forward_steps": 0, "jump_forward_tokens": 0,
                      "mixed_steps": 0, "stall_steps": 0, "num_preempted_reqs": 0,
                      **{f"stall_steps_{r}": 0 for r in STALL_REASONS}}
        self._retracted_now: list[Req] = []
        self._token_bytes = token_bytes_fn
        self._thinking_vocab: ThinkingVocab | None = None  # thinking requests' marker tables, built on first use
        self.eos_ids = frozenset(eos_ids)
        self._expect: list[tuple[Req, int]] = []
        self.last_forward: tuple[bool, float] | None = None  # set by forward(), read and cleared by the loop

    # ---- input ------------------------------------------------------------------------------------------------
    def handle(self, msg: ToScheduler) -> FlushCacheOut | InternalStateOut | None:
        if isinstance(msg, TokenizedGenerateReq):
            self._add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.abort_all, msg.message)
        elif isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        elif isinstance(msg, GetInternalStateReq):
            return InternalStateOut(state=self.internal_state())
        return None

    def _add_request(self, msg: TokenizedGenerateReq) -> None:
        p = msg.sampling_params
        self._arrivals += 1
        req = Req(msg.rid, msg.input_ids, p, arrival=self._arrivals, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  priority=msg.priority if self.low_first is not None else 0)
        if msg.prediction_ids:
            req.spec.prediction = np.asarray(msg.prediction_ids, dtype=np.int64)
        if p.sampling_seed is None:  # batch-independent default seed, distinct per rid (n > 1 copies differ)
            req.seed = mix_seed(self.cfg.model.random_seed, zlib.crc32(msg.rid.encode()))
        if not msg.input_ids:
            return self._finish_abort(req, "the prompt is empty")
        if len(msg.input_ids) + p.max_new_tokens > self.kv.table.max_context:
            return self._finish_abort(req, f"prompt plus max_new_tokens exceeds the context length "
                                           f"({self.kv.table.max_context})")
        if _is_constrained(p):
            if self.grammar_backend is None:
                return self._finish_abort(req, "constrained decoding is disabled (no grammar backend)")
            fut = self.grammar_backend.get_future(p)
            if fut is not None:
                req.grammar_state.future, req.grammar_state.wait_since = fut, time.monotonic()
                self.grammar_queue.append(req)
                return None
        elif p.thinking_budget is not None:  # unconstrained, but its thinking is bounded
            try:
                req.grammar = self._with_thinking(None, p)
            except ValueError as e:
                return self._finish_abort(req, str(e))
        self.waiting.append(req)
        return None

    def abort(self, rid: str | None, abort_all: bool = False, message: str = "aborted by client") -> None:
        """Drop the request `rid` and its n>1 samples `rid_i` (or all), wherever they are, freeing their KV.
        Not a bare prefix match: aborting "ab2" must not abort "ab20"."""
        def hit(r: Req) -> bool:
            return abort_all or (rid is not None and (r.rid == rid or r.rid.startswith(rid + "_")))

        for req in [r for r in self.grammar_queue if hit(r)]:
            self.grammar_queue.remove(req)
            self._compile_of(req).cancel()
            self._finish_abort(req, message)
        for req in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(req)
            self._finish_abort(req, message)
        if self.chunked is not None and hit(self.chunked):
            req, self.chunked = self.chunked, None
            self.kv.release(req)
            self._finish_abort(req, message)
        for req in [r for r in self.running if hit(r)]:
            self.running.remove(req)
            self.kv.release(req)
            self._finish_abort(req, message)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def step(self) -> list[ReqTokenOut]:
        """One iteration: admit compiled grammars -> schedule (decode rows, then prefill under the remaining
        budget) -> forward -> sample and finish -> report. Idle: check the KV invariant and reset the
        reservation ratio."""
        batch = self.begin_step()
        logits = self.forward(batch) if batch is not None else None
        return self.end_step(batch, logits)

    def forward(self, batch: Batch) -> torch.Tensor:
        """The step's model forward; `last_forward` = (every row a decode row, seconds in runner.forward) for
        the process loop's step timing (the ForwardBatch is built outside the timed span: host work)."""
        fb = batch.forward_batch()
        t = time.perf_counter()
        logits = self.runner.forward(fb)
        self.last_forward = (batch.is_decode, time.perf_counter() - t)
        return logits

    def begin_step(self) -> Batch | None:
        """The host half before the forward: poll grammars and plan this step's batch (None: nothing to run).
        `end_step` must follow before any other call that changes requests (handle may add new ones)."""
        self._poll_grammars()
        self._expect = [(r, len(r.output_ids)) for r in self.running]  # who should get a token this step
        self._retracted_now = []
        return self._schedule()

    def end_step(self, batch: Batch | None, logits: torch.Tensor | None) -> list[ReqTokenOut]:
        """The host half after the forward: sample, finish, count; returns the step's outputs."""
        if batch is not None:
            if logits is None:
                raise RuntimeError("a step's batch came back without its logits")
            self._count(batch)
            running = {id(r) for r in self.running}
            for req in self.processor.process(batch, logits):
                self._after_sample(req, id(req) in running)
        elif not self.has_work():
            self.new_token_ratio = self.init_ratio
            self.check_memory(strict=self.cfg.cache.strict_memory_check)
        self._count_stalls(self._expect, batch)
        outs, self._outs = self._outs, []
        return outs

    def has_work(self) -> bool:
        return bool(self.grammar_queue or self.waiting or self.running or self.chunked is not None)

    def _schedule(self) -> Batch | None:
        ordered = order_waiting(self.policy, self.waiting, self.kv.tree, self.low_first)
        if self.low_first is not None and ordered and self.chunked is None:
            self._preempt(ordered[0])
        if self.mixed:
            dplan = self._plan_decode()
            # After a retraction admit nothing this step: the freed room is for the survivors.
            nothing_waits = not ordered and self.chunked is None  # the common decode step: no adder to build
            pplan = NO_PREFILL if dplan.retracted or nothing_waits else self._plan_prefill(ordered, dplan.num_tokens)
        else:
            pplan = self._plan_prefill(ordered, 0)
            dplan = NO_DECODE if pplan.reqs else self._plan_decode()
        reqs = dplan.decode + dplan.extend + pplan.reqs
        if not reqs:
            return None
        # a verify row (speculative drafts) wants the logits of every position, other extend rows the last
        offsets = ([[0]] * len(dplan.decode)
                   + [list(range(r.extend_len)) if r.spec.draft_ids else [r.extend_len - 1] for r in dplan.extend]
                   + pplan.offsets)
        return Batch(reqs, len(dplan.decode), torch.cat(dplan.slots + pplan.slots), offsets)

    def _plan_prefill(self, ordered: list[Req], decode_tokens: int) -> PrefillPlan:
        adder = PrefillAdder(self.kv, self.cfg.scheduler, self.running, self.new_token_ratio, decode_tokens)
        plan = adder.plan(self.chunked, ordered)
        for req, why in plan.rejected:
            self.waiting.remove(req)
            self._finish_abort(req, why)
        for req in plan.admitted:
            self.waiting.remove(req)
            if not req.admitted:
                req.admitted, req.cached_tokens = True, req.cached_len
                self.stats["prompt_tokens"] += req.prompt_len
                self.stats["cached_tokens"] += req.cached_len
        self.chunked = plan.chunked
        return plan

    def _plan_decode(self) -> DecodePlan:
        if not self.running:
            return NO_DECODE
        dplan = plan_decode(self.kv, self.running, others_hold_slots=self.chunked is not None)
        if dplan.retracted:
            self._retracted_now.extend(dplan.retracted)
            self.waiting.extend(dplan.retracted)
            self.stats["num_retracted_reqs"] += len(dplan.retracted)
            self.new_token_ratio = max(self.new_token_ratio, retract_ratio(self.running))
            log.info("retracted %d requests (new_token_ratio %.2f)", len(dplan.retracted), self.new_token_ratio)
        else:
            decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
            self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - decay)
        for req, why in dplan.aborted:
            self._finish_abort(req, why)
        return self.spec.attach(dplan) if self.spec is not None else dplan

    def _preempt(self, head: Req) -> None:
        """Priority scheduling: retract running requests ranked below `head` by more than the threshold
        (policy.preemption_victims order) until `head` would fit this step; none when it fits already, or when
        even all of them would not make room."""
        def fits() -> bool:
            reserved = sum(reservation(r, self.new_token_ratio) for r in self.running) + len(self.running)
            need = head.fill_len - self.kv.peek_match(head) + reservation(head, self.new_token_ratio)
            return (len(self.running) < self.cfg.scheduler.max_running_requests
                    and self.kv.table.available() > 0 and need <= self.kv.available() - reserved)

        if fits() or head.fill_len + 1 > self.kv.total:
            return
        sched = self.cfg.scheduler
        for req in preemption_victims(head, self.running, sched.priority_scheduling_preemption_threshold,
                                      bool(self.low_first)):
            self.running.remove(req)
            self.kv.release(req)
            req.num_retractions += 1
            self.waiting.append(req)
            self._retracted_now.append(req)
            self.stats["num_retracted_reqs"] += 1
            self.stats["num_preempted_reqs"] += 1
            if fits():
                break

    def _after_sample(self, req: Req, was_running: bool) -> None:
        if req.finished:
            if was_running:
                self.running.remove(req)
            self.kv.release(req)
            self._emit(req)
            return
        jumped = req.grammar_state.jump_tokens
        if jumped:
            # Jump-forward appended tokens without KV: the request stays running and computes them in the
            # next step as an extend row (decode.py), together with everyone else's decode rows.
            req.grammar_state.jump_tokens = 0
            self.stats["jump_forward_steps"] += 1
            self.stats["jump_forward_tokens"] += jumped
        if not was_running:
            self.running.append(req)
        if len(req.output_ids) - req.sent_len >= self.cfg.scheduler.stream_interval or req.sent_len == 0:
            self._emit(req)

    def _count_stalls(self, expect: list[tuple[Req, int]], batch: Batch | None) -> None:
        """A stall step: a request running when the step began is still alive and got no token."""
        served = {id(r) for r in batch.reqs} if batch is not None else set()
        retracted = {id(r) for r in self._retracted_now}
        reasons = set()
        for req, before in expect:
            if req.finished or len(req.output_ids) > before:
                continue
            if id(req) in retracted:
                reasons.add("retraction")
            elif id(req) not in served:
                reasons.add("prefill_only")
            else:
                reasons.add("grammar_wait" if req.grammar is not None else "other")
        if reasons:
            self.stats["stall_steps"] += 1
            for r in reasons:
                self.stats[f"stall_steps_{r}"] += 1

    @staticmethod
    def _compile_of(req: Req) -> CompileFuture:
        """The compile a request in the grammar queue waits on (every such request has one)."""
        fut = req.grammar_state.future
        if fut is None:
            raise RuntimeError(f"request {req.rid} is in the grammar queue without a compile")
        return fut

    def _poll_grammars(self) -> None:
        timeout = self.cfg.grammar.grammar_compile_timeout
        for req in list(self.grammar_queue):
            fut = self._compile_of(req)
            if fut.done():
                self.grammar_queue.remove(req)
                try:
                    compiled = fut.result()
                except Exception as e:  # a compile error aborts only this request
                    self._finish_abort(req, f"failed to compile the grammar: {e}")
                    continue
                if compiled is None:
                    self._finish_abort(req, "invalid grammar")
                    continue
                try:
                    req.grammar = self._with_thinking(compiled.copy(), req.sampling_params)
                except ValueError as e:
                    self._finish_abort(req, str(e))
                    continue
                self.waiting.append(req)
            elif time.monotonic() - req.grammar_state.wait_since > timeout:
                self.grammar_queue.remove(req)
                fut.cancel()
                self._finish_abort(req, f"grammar compilation timed out after {timeout:g} s")

    def _with_thinking(self, inner: Grammar | None, p: SamplingParams) -> Grammar | None:
        """A thinking request's grammar: free thinking, then `inner` (runtime/constrained/thinking.py)."""
        if p.think_end is None:
            return inner
        if self._thinking_vocab is None:
            if self._token_bytes is None:
                raise ValueError("think_end needs the tokenizer's token bytes (this scheduler has none)")
            self._thinking_vocab = ThinkingVocab(self._token_bytes, self.runner.vocab_size)
        return wrap_thinking(inner, self._thinking_vocab, self.eos_ids, p.think_end, p.think_start,
                             p.thinking_budget, p.max_new_tokens)

    # ---- output -----------------------------------------------------------------------------------------------
    def _finish_abort(self, req: Req, message: str) -> None:
        req.finish_reason = FinishAbort(message=message)
        self._emit(req)

    def _emit(self, req: Req) -> None:
        p = req.sampling_params
        new = req.output_ids[req.sent_len :]
        req.sent_len = len(req.output_ids)
        out = ReqTokenOut(
            rid=req.rid, new_ids=new, finish_reason=req.finish_reason, prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            num_retractions=req.num_retractions, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens, no_stop_trim=p.no_stop_trim,
            stop_trim=req.stop_trim, spec_verify_ct=req.spec.verify_ct, spec_accepted_tokens=req.spec.accepted,
            spec_draft_tokens=req.spec.drafted,
        )
        if req.logprobs.wanted:
            out.output_logprobs, req.logprobs.out = req.logprobs.out, []
            if req.logprobs.top_num:
                out.output_top_logprobs, req.logprobs.out_top = req.logprobs.out_top, []
            if req.logprobs.start_len >= 0 and req.prefilled and not req.logprobs.inputs_sent:
                req.logprobs.inputs_sent = True
                out.input_logprobs = req.logprobs.inputs
                if req.logprobs.top_num:
                    out.input_top_logprobs = req.logprobs.input_top
        self._outs.append(out)

    def _count(self, batch: Batch) -> None:
        self.stats["forward_steps"] += 1
        extend = batch.extend_tokens  # verify rows count as decode work (drafts included)
        self.stats["decode_tokens"] += batch.num_tokens - extend
        self.stats["prefill_tokens"] += extend
        self.stats["mixed_steps"] += 0 < batch.num_decode < batch.size

    # ---- control ----------------------------------------------------------------------------------------------
    def flush_cache(self) -> FlushCacheOut:
        if self.has_work():
            return FlushCacheOut(success=False, message="cannot flush the cache while requests are running")
        ok = self.kv.flush()
        if ok and self.kv.hicache is not None:  # KVManager.flush also emptied the file tier
            return FlushCacheOut(success=True, message="Cache flushed (the hierarchical cache's file tier too).")
        return FlushCacheOut(success=ok, message="" if ok else "the cache has locked entries")

    def internal_state(self) -> dict[str, Any]:
        s = self.stats
        return {
            "num_running_reqs": len(self.running) + (self.chunked is not None),
            "num_waiting_reqs": len(self.waiting) + len(self.grammar_queue),
            "num_grammar_queue_reqs": len(self.grammar_queue),
            # prompt tokens of the not-yet-admitted requests (what /get_load adds to the used slots)
            "num_waiting_tokens": sum(len(r.origin_input_ids) for r in (*self.waiting, *self.grammar_queue)),
            "max_total_num_tokens": self.kv.total,
            "kv_free_slots": self.kv.free_size(),
            "kv_evictable_slots": self.kv.evictable_size(),
            "kv_locked_slots": self.kv.locked_size(),
            "cache_hit_rate": s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0,
            "num_retracted_reqs": s["num_retracted_reqs"],
            "num_preempted_reqs": s["num_preempted_reqs"],
            "new_token_ratio": self.new_token_ratio,
            "schedule_policy": self.policy,
            "radix_cache": self.kv.tree is not None,
            "forward_steps": s["forward_steps"],
            "prefill_tokens": s["prefill_tokens"],
            "decode_tokens": s["decode_tokens"],
            "jump_forward_steps": s["jump_forward_steps"],
            "jump_forward_tokens": s["jump_forward_tokens"],
            "mixed_steps": s["mixed_steps"],
            "stall_steps": s["stall_steps"],
            **{f"stall_steps_{r}": s[f"stall_steps_{r}"] for r in STALL_REASONS},
            **self._spec_state(),
            **(self.kv.hicache.state() if self.kv.hicache is not None else {}),
            **self.kv.pool_state(),
            **self._compile_state(),
        }

    def on_idle(self) -> None:
        """No work this turn (a step boundary too): the runner may swap in decode graphs that became ready."""
        poll = getattr(getattr(self.runner, "compile", None), "poll", None)
        if poll is not None:
            poll()

    def _compile_state(self) -> dict[str, Any]:
        """Compiled decode buckets (a runner with `compile_state`) and this process's fallbacks so far."""
        state = getattr(self.runner, "compile_state", None)
        return {**(state() if state is not None else {}), "fallbacks": fallbacks.recorded()}

    def _spec_state(self) -> dict[str, Any]:
        """Speculative decoding counters, mean tokens per verify step and draft acceptance rate (when on)."""
        if self.spec is None:
            return {}
        st = self.spec.stats
        verify, drafts = st["spec_verify_ct"], st["spec_draft_tokens"]
        return {**st, "spec_accept_length": st["spec_emitted_tokens"] / verify if verify else 0.0,
                "spec_accept_rate": st["spec_accepted_tokens"] / drafts if drafts else 0.0}

    def check_memory(self, strict: bool = False) -> bool:
        """Slot accounting: free + evictable + locked + request-owned == total (request-owned is 0 when idle),
        and the speculative draft model's own pool (free + held by running requests == total). Logs a warning
        naming the numbers, or raises RuntimeError when `strict`. Returns whether it held."""
        live = self.running + ([self.chunked] if self.chunked is not None else [])
        owned = sum(r.seq_len - r.tree_len for r in live)
        free, ev, lk, total = self.kv.free_size(), self.kv.evictable_size(), self.kv.locked_size(), self.kv.total
        ok = free + ev + lk + owned == total and (live or lk == 0)
        if self.kv.tree is not None and strict:
            self.kv.tree.check_integrity()
        draft = self.spec.proposer.check(live) if self.spec is not None else None  # the draft model's pool
        draft = draft or self.kv.check(live)  # a second pool of the same tokens (sliding-window layers)
        if not ok or draft:
            msg = draft if ok else (f"KV pool leak: free {free} + evictable {ev} + locked {lk} + request-owned "
                                    f"{owned} != total {total} (running {len(live)})")
            if strict:
                raise RuntimeError(msg)
            log.warning(msg)
        return bool(ok) and draft is None
