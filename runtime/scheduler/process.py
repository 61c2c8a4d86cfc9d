"""After the forward: commit the new KV, record prompt logprobs, sample, advance grammars, check finishes.

Input: the step's `Batch` and the runner's logits [K, V] float32 (rows follow `batch.logit_rows`).
Output: the requests that sampled a token or finished; the scheduler turns them into ReqTokenOut.
A prefill whose prompt is complete (or a chunk of one) enters the tree at once (`cache_unfinished`), so
requests deferred for in-batch sharing, and `n > 1` copies, hit it next step.

Logprobs are log_softmax of the model's raw logits (before penalties, bias, grammar mask and temperature),
the same distribution for prompt and output positions.
"""

from __future__ import annotations

import torch

from runtime.core import Batch, Req, finish_length
from runtime.sampling import SamplingInfo, compute_logprobs, sample, top_logprobs
from runtime.scheduler.cache import KVManager
from runtime.scheduler.finish import check_finished


def _top(lp_rows: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    vals, ids = top_logprobs(lp_rows, k)
    return [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), ids.tolist(), strict=True)]


class ResultProcessor:
    def __init__(self, kv: KVManager, vocab_size: int, eos_ids: frozenset[int], decode_fn, default_seed: int):
        self.kv = kv
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.decode_fn = decode_fn
        self.default_seed = default_seed

    def process(self, batch: Batch, logits: torch.Tensor) -> list[Req]:
        """Update every request of `batch`; return those that produced a token or finished this step."""
        samplers: list[Req] = []
        rows: list[int] = []
        done: list[Req] = []
        for b, req in enumerate(batch.reqs):
            start, count = batch.logit_rows[b]
            old_cached = req.cached_len
            req.cached_len, req.extend_len = req.seq_len, 0
            if batch.is_decode:
                samplers.append(req)
                rows.append(start)
                continue
            if req.wants_input_logprobs:
                self._prompt_logprobs(req, old_cached, batch.logit_offsets[b], logits[start : start + count])
            complete = req.cached_len == len(req.fill_ids)
            self.kv.cache_unfinished(req)
            if not complete:
                continue
            req.prefilled = True
            if req.remaining_new_tokens == 0:
                req.finish_reason = finish_length(0)
                done.append(req)
            else:
                samplers.append(req)
                rows.append(start + count - 1)
        if samplers:
            self._sample(samplers, logits[rows])
        return samplers + done

    def _prompt_logprobs(self, req: Req, old_cached: int, offs: list[int], lg: torch.Tensor) -> None:
        """Append logprobs of prompt tokens scored by this chunk's logits (offs[i] -> position old_cached+offs[i])."""
        ids = req.origin_input_ids
        start = req.logprob_start_len
        if start == 0 and old_cached == 0:
            req.in_logprobs.append((None, ids[0]))
            req.in_top_logprobs.append(None)
        keep = [i for i, o in enumerate(offs) if max(start - 1, 0) <= old_cached + o < len(ids) - 1]
        if not keep:
            return
        lp = compute_logprobs(lg[keep])
        targets = [ids[old_cached + offs[i] + 1] for i in keep]
        chosen = lp.gather(-1, torch.tensor(targets)[:, None]).squeeze(-1).tolist()
        req.in_logprobs.extend(zip(chosen, targets, strict=True))
        if req.top_logprobs_num:
            req.in_top_logprobs.extend(_top(lp, req.top_logprobs_num))

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
        mask = None
        if any(r.grammar is not None for r in reqs):
            mask = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
            for b, r in enumerate(reqs):
                if r.grammar is not None:
                    r.grammar.fill_mask(mask[b])
        next_ids = sample(logits, info, mask).next_ids.tolist()
        want = [b for b, r in enumerate(reqs) if r.return_logprob]
        lp = compute_logprobs(logits[want]) if want else None
        for b, (req, tok) in enumerate(zip(reqs, next_ids, strict=True)):
            req.output_ids.append(tok)
            if req.grammar is not None:
                req.grammar.accept_token(tok)
            if lp is not None and req.return_logprob:
                row = lp[want.index(b)]
                req.out_logprobs.append((float(row[tok]), tok))
                if req.top_logprobs_num:
                    req.out_top_logprobs.extend(_top(row[None], req.top_logprobs_num))
            check_finished(req, self.eos_ids, self.decode_fn)
