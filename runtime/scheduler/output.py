"""After the forward: commit the new KV, record prompt logprobs, sample, advance grammars, check finishes.

Input: the step's `Batch` and the runner's logits [K, V] float32 (rows follow `batch.logit_rows`).
Output: the requests that sampled a token or finished; the scheduler turns them into ReqTokenOut.
Rows [0, num_decode) of the batch are decode rows (sample at once); the others are extend rows: a prompt
chunk (its prompt logprobs; it samples once the prompt is complete) or a running request's jump-forward
extend (samples its last row). Extend rows normally entered the tree while planning (same-step sharing);
one that did not (`tree_len < cached_len`, e.g. `n > 1` copies) enters it here (`cache_unfinished`).

Speculative verify rows (`req.spec.draft_ids` set) are handed to the Speculator (runtime/scheduler/speculative.py),
which appends their emitted tokens through `append_token` (its `TokenSink`) and frees their rejected draft slots.

Logprobs are log_softmax of the model's raw logits (before penalties, bias, grammar mask and temperature),
the same distribution for prompt and output positions.

Grammar: one packed bitmask for the constrained rows only (`apply_grammar_masks`) is applied to the sampled
rows' logits; a batch without grammars pays one list scan. A grammar that rejects a token aborts only that
request. Jump-forward (unless disabled): after a token, text the grammar forces is tokenized and appended at
once (`req.grammar_state.jump_tokens` = how many), re-tokenized together with the token sampled this step; the scheduler then
computes the appended tokens in the next step as an extend row next to the decode rows. Nothing already
streamed or already in the KV pool is ever replaced, so the client's token stream never needs correcting.

Isolation: any other exception while processing one request's sampled token (a bug; tests inject one through
`append_token`) aborts only that request ("internal error while processing request: ..."), logged with its
traceback; the scheduler frees it through the normal finish path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from runtime.config import Config
from runtime.constrained.closing import Closers, in_string
from runtime.constrained.grammar import apply_grammar_masks, plan_jump_forward
from runtime.constrained.seam import Grammar
from runtime.executor.staging import to_device
from runtime.messages import FinishAbort, FinishLength
from runtime.sampling import SamplingInfo, compute_logprobs, sample, top_logprobs
from runtime.scheduler.cache import KVManager
from runtime.scheduler.core import Batch, Req
from runtime.scheduler.finish import check_finished
from runtime.scheduler.speculative import Speculator

log = logging.getLogger(__name__)


def _top(lp_rows: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    vals, ids = top_logprobs(lp_rows, k)
    return [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), ids.tolist(), strict=True)]


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]; all rows in order are the tensor itself, with no [B, V] copy (a caller that writes into it
    clones first). The index goes up through pinned memory: a pageable copy would wait for the GPU forward."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[to_device(rows, torch.int64, logits.device)]


class ResultProcessor:
    """Turns a step's logits into tokens; the Speculator's `TokenSink` (`append_token`)."""

    def __init__(self, kv: KVManager, vocab_size: int, eos_ids: frozenset[int], cfg: Config,
                 decode_fn: Callable[[list[int]], str] | None = None,
                 encode_fn: Callable[[str], list[int]] | None = None,
                 token_bytes: Callable[[int], bytes] | None = None, spec: Speculator | None = None) -> None:
        self.kv = kv
        self.close_reserve = cfg.grammar.json_close_reserve  # JSON requests close in their last tokens (closing.py)
        self._closers: Closers | None = None  # built on first use (one pass over the vocabulary)
        self.spec = spec  # verifies speculative rows (runtime/scheduler/speculative.py); None: speculation off
        # encode_fn(text) -> ids, no specials; None: jump-forward off (disabled, or no tokenizer)
        self.jump_encode = None if cfg.grammar.disable_jump_forward else encode_fn
        self.token_bytes = token_bytes  # None: no boundary re-tokenization (forced text tokenized alone)
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.decode_fn = decode_fn
        self.default_seed = cfg.model.random_seed

    def process(self, batch: Batch, logits: torch.Tensor) -> list[Req]:
        """Update every request of `batch`; return those that produced a token or finished this step."""
        samplers: list[Req] = []
        rows: list[int] = []
        done: list[Req] = []
        verify: list[tuple[Req, int]] = []
        for b, req in enumerate(batch.reqs):
            start, count = batch.logit_rows[b]
            if req.spec.draft_ids:  # a speculative verify row: logits rows [start, start + count), count = 1 + k
                verify.append((req, start))
                continue
            old_cached = req.cached_len
            req.cached_len, req.extend_len = req.seq_len, 0
            if b < batch.num_decode:
                samplers.append(req)
                rows.append(start)
                continue
            if req.wants_input_logprobs:
                self._prompt_logprobs(req, old_cached, batch.logit_offsets[b], logits[start : start + count])
            complete = req.cached_len == req.fill_len
            if req.tree_len < req.cached_len:  # not inserted while planning (see KVManager.cache_planned)
                self.kv.cache_unfinished(req)
            if not complete:
                continue
            if req.prefilled:  # a running request's jump-forward extend, or a readmission after retraction
                samplers.append(req)
                rows.append(start + count - 1)
                continue
            req.prefilled = True
            if req.remaining_new_tokens == 0:
                req.finish_reason = FinishLength(length=0)
                done.append(req)
            else:
                samplers.append(req)
                rows.append(start + count - 1)
        if samplers:
            self._sample(samplers, _rows(logits, rows))
        if verify:
            assert self.spec is not None, "a verify row without a speculator"
            self.spec.verify(self, verify, logits)
        return samplers + [r for r, _ in verify] + done

    def _prompt_logprobs(self, req: Req, old_cached: int, offs: list[int], lg: torch.Tensor) -> None:
        """Append logprobs of prompt tokens scored by this chunk's logits (offs[i] -> position old_cached+offs[i])."""
        ids = req.origin_input_ids
        start = req.logprobs.start_len
        if start == 0 and old_cached == 0:
            req.logprobs.inputs.append((None, ids[0]))
            req.logprobs.input_top.append(None)
        keep = [i for i, o in enumerate(offs) if max(start - 1, 0) <= old_cached + o < len(ids) - 1]
        if not keep:
            return
        lp = compute_logprobs(lg[keep])
        targets = [ids[old_cached + offs[i] + 1] for i in keep]
        chosen = lp.gather(-1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(-1).tolist()
        req.logprobs.inputs.extend(zip(chosen, targets, strict=True))
        if req.logprobs.top_num:
            req.logprobs.input_top.extend(_top(lp, req.logprobs.top_num))

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample one token per request from its logits row [B, V], append it, check finishes."""
        stop_ids = [[] if r.sampling_params.ignore_eos else sorted(self.eos_ids | set(r.sampling_params.stop_token_ids))
                    for r in reqs]
        info = SamplingInfo.build(
            params=[r.sampling_params for r in reqs],
            output_ids=[r.output_ids for r in reqs],
            steps=[len(r.output_ids) for r in reqs],
            vocab_size=self.vocab_size,
            stop_ids=stop_ids,
            default_seed=self.default_seed,
            device=logits.device,
            seeds=[r.seed for r in reqs],
        )
        want = [b for b, r in enumerate(reqs) if r.logprobs.wanted]
        lp = compute_logprobs(_rows(logits, want)) if want else None  # raw logits: before the grammar mask
        grammars = [r.grammar for r in reqs]
        if any(g is not None for g in grammars):
            logits = logits.clone()  # the mask goes in place; the forward's output is an inference tensor
            apply_grammar_masks(logits, grammars)
            self._close(reqs, logits)
        next_ids = sample(logits, info).next_ids.tolist()
        for b, (req, tok) in enumerate(zip(reqs, next_ids, strict=True)):
            try:
                self.append_token(req, tok, lp[want.index(b)] if lp is not None and req.logprobs.wanted else None)
            except Exception as e:  # an error in one request's processing aborts that request only
                log.exception("internal error while processing request %s", req.rid)
                why = f"internal error while processing request: {type(e).__name__}: {e}"
                req.finish_reason = FinishAbort(message=why)

    def _close(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Rows of JSON requests in the last tokens of their budget keep only closing tokens where their grammar
        allows one (runtime/constrained/closing.py); a request whose choices that narrowed is `budget_closed`."""
        if not self.close_reserve or self.token_bytes is None:
            return
        rows = [b for b, r in enumerate(reqs) if r.closes_within(self.close_reserve)]
        if not rows:
            return
        if self._closers is None:
            self._closers = Closers(logits.shape[1], self.token_bytes)
        tb = self.token_bytes
        inside = [in_string(b"".join(tb(t) for t in reqs[b].output_ids[_answer_start(reqs[b]):]))
                  for b in rows]  # the answer only: a thinking model's reasoning is no JSON
        for b, narrowed in zip(rows, self._closers.restrict(logits, rows, inside), strict=True):
            reqs[b].grammar_state.budget_closed |= narrowed

    def append_token(self, req: Req, tok: int, lp_row: torch.Tensor | None, jump: bool = True) -> None:
        """Append the sampled `tok` to `req` (with its logprobs from `lp_row` [V]), advance its grammar, check
        finishes, jump forward (unless `jump` is False: a speculative step's tokens before its last). Raising
        here aborts `req` only (the normal finish path frees it); the token is appended before anything
        can raise."""
        req.output_ids.append(tok)
        if lp_row is not None:
            req.logprobs.out.append((float(lp_row[tok]), tok))
            if req.logprobs.top_num:
                req.logprobs.out_top.extend(_top(lp_row[None], req.logprobs.top_num))
        if req.grammar is not None:
            try:
                req.grammar.accept_token(tok)
            except Exception as e:  # a broken grammar state ends this request only
                req.finish_reason = FinishAbort(message=f"grammar rejected sampled token {tok}: {e}")
                return
        check_finished(req, self.eos_ids, self.decode_fn)
        if jump and req.grammar is not None and not req.finished and self.jump_encode and not req.logprobs.wanted:
            self._jump_forward(req, req.grammar, self.jump_encode)

    def _jump_forward(self, req: Req, grammar: Grammar, encode: Callable[[str], list[int]]) -> None:
        """Append the grammar-forced continuation of `req`, re-tokenizing it together with the token sampled
        this step (so the ids are what the tokenizer gives for the whole text where that token merges with the
        forced text). Only that last token may be replaced: it has not been streamed yet (sent_len is behind it)
        and has no KV yet (decode computes it next step), so neither the client nor the pool sees the change."""
        window = 1 if self.token_bytes is not None and len(req.output_ids) > req.sent_len else 0
        try:
            plan = plan_jump_forward(grammar, req.output_ids, self.token_bytes or (lambda t: b""), encode,
                                     window=window)
        except Exception:  # jump-forward is an optimisation: on any surprise decode normally
            return
        if plan is None or plan.rollback > window:
            return
        ids = plan.new_ids[: req.remaining_new_tokens + plan.rollback]
        if not ids:
            return
        try:
            grammar.replace_tail(plan.rollback, ids)  # restores the grammar state when it raises
        except ValueError:
            return
        if plan.rollback:
            del req.output_ids[-plan.rollback :]
        req.output_ids.extend(ids)
        req.grammar_state.jump_tokens = len(ids)
        check_finished(req, self.eos_ids, self.decode_fn)


def _answer_start(req: Req) -> int:
    """Output tokens before the constrained answer (a thinking model's reasoning; 0 for plain grammars)."""
    return (req.grammar.free_prefix or 0) if req.grammar is not None else 0
