"""Batched sampling: logits [B, V] float32 + SamplingInfo (+ grammar mask) -> next token ids and logprobs.

Order (each stage skipped when no request in the batch uses it):
  penalties (repetition, frequency, presence, min_new_tokens stop-id mask) -> logit_bias -> allowed_mask
  -> logprobs := log_softmax(processed logits) at the chosen id (before temperature)
  -> temperature -> top-k -> top-p (over the top-k set, renormalised) -> min-p (relative to the top prob)
  -> sample (inverse CDF with one uniform per row drawn from mix(seed, step)) or argmax for greedy rows.

A row whose every token is disallowed has no valid sample; its result is unspecified (the grammar layer
never produces such a mask: EOS stays allowed in final states).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.executor.staging import to_device
from runtime.sampling.info import SamplingInfo, mix_seed


class SampleOutput(NamedTuple):
    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, log_softmax of the processed logits at next_ids
    # (pre-temperature); None unless asked for (`need_logprobs`): a [B, V] log_softmax per step is not free.


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim ([..., V] -> [...] int64), the first index among ties as torch.argmax gives.
    `max(dim).indices` because on the CPU it is the vectorized reduction: 0.44 vs 1.11 ms at [32, 49152]
    float32 on 2 threads (argmax's pair reduction is not), and it runs once per decode step."""
    return logits.max(dim=-1).indices


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary in float32 ([..., V] -> [..., V]); used for prompt logprobs."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logprobs per row and their token ids: ([B, k] float32, [B, k] int64), descending."""
    values, ids = torch.topk(logprobs, k=min(k, logprobs.shape[-1]), dim=-1)
    return values, ids


def process_logits(
    logits: torch.Tensor, info: SamplingInfo, allowed_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalties, logit bias and the allowed mask applied to a copy of `logits` [B, V] (or the input itself
    when nothing applies). Disallowed tokens (allowed_mask False) become -inf."""
    if not info.needs_processing and allowed_mask is None:
        return logits
    x = logits.float().clone()
    if info.counts is not None:
        seen = info.counts > 0
        if info.repetition_penalties is not None:
            rp = info.repetition_penalties[:, None]
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        if info.frequency_penalties is not None:
            x -= info.frequency_penalties[:, None] * info.counts
        if info.presence_penalties is not None:
            x -= info.presence_penalties[:, None] * seen.float()
    if info.min_tokens_rows is not None:
        x[info.min_tokens_rows, info.min_tokens_ids] = float("-inf")
    if info.logit_bias is not None:
        x += info.logit_bias
    if allowed_mask is not None:
        x.masked_fill_(~allowed_mask, float("-inf"))
    return x


def _filtered_probs(logits: torch.Tensor, info: SamplingInfo, rows: list[int], idx: torch.Tensor) -> torch.Tensor:
    """Probabilities [R, V] of the sampled rows (`rows` on the host, `idx` the same on the device) after
    temperature, top-k, top-p and min-p, in vocabulary order and unnormalised: filtered-out tokens are 0, the
    kept ones keep their relative weights.

    Each filter keeps the tokens whose probability is >= a per-row threshold (tokens tied with the
    threshold are all kept), and leaves rows that do not use it exactly as they are. Which rows use a filter
    is decided from host lists, so no device value is read. No full sort on CPU: there a sort of [R, V]
    costs more than the model's decode step (radix select instead); on CUDA the sort is the sync-free way.
    """
    if len(rows) == logits.shape[0]:  # every row samples: no gather
        probs = torch.softmax(logits / info.temperatures[:, None], dim=-1)
    else:
        probs = torch.softmax(logits[idx] / info.temperatures[idx, None], dim=-1)
    V = probs.shape[-1]
    if info.need_top_k:
        ks = [info.top_k_list[b] for b in rows]
        use = [i for i, k in enumerate(ks) if k < V]
        top_ks = info.top_ks[idx]
        probs = _cut_rows(probs, use, lambda sub, sel: _top_k_threshold(sub, top_ks[sel], max(ks[i] for i in use)))
    if info.need_top_p:
        use = [i for i, b in enumerate(rows) if info.top_p_list[b] < 1.0]
        top_ps = info.top_ps[idx]
        probs = _cut_rows(probs, use, lambda sub, sel: _mass_threshold(sub, top_ps[sel] * sub.sum(dim=-1)))
    if info.need_min_p:
        probs.masked_fill_(probs < info.min_ps[idx, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _cut_rows(probs: torch.Tensor, use: list[int], threshold) -> torch.Tensor:
    """Zero probs below `threshold(sub, sel)` ([S] per selected row) in rows `use` (host indices into the R
    rows). Works in place on `probs` (a fresh tensor owned by the sampler)."""
    if len(use) == probs.shape[0]:
        return probs.masked_fill_(probs < threshold(probs, slice(None))[:, None], 0.0)
    if use:
        sel = to_device(use, torch.int64, probs.device)
        sub = probs[sel]
        probs[sel] = sub.masked_fill(sub < threshold(sub, sel)[:, None], 0.0)
    return probs


def _top_k_threshold(probs: torch.Tensor, top_ks: torch.Tensor, kmax: int | None = None) -> torch.Tensor:
    """The top_ks[r]-th largest value of each row [S, V] -> [S] (`kmax`: host max of top_ks, read from the
    device when not given). topk for k <= 256, else radix select on CPU and a sort on CUDA."""
    if kmax is None:
        kmax = int(top_ks.max())
    if kmax <= 256:
        return torch.topk(probs, kmax, dim=-1).values.gather(-1, (top_ks - 1)[:, None]).squeeze(-1)
    if probs.is_cuda:
        return torch.sort(probs, dim=-1, descending=True).values.gather(-1, (top_ks - 1)[:, None]).squeeze(-1)
    return _radix_threshold(probs, None, (top_ks - 1).float())


def _mass_threshold(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """top-p threshold [S]: radix select on CPU, sort on CUDA (same set of kept tokens)."""
    return _sort_threshold(probs, target) if probs.is_cuda else _radix_threshold(probs, probs, target)


def _sort_threshold(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`_radix_threshold(probs, probs, target)` by a sort, without data-dependent shapes (no host sync).

    In descending order, a token's exclusive prefix mass is the weight of the tokens before it; the first
    token of a tie group sees exactly the weight strictly greater than it. The kept tokens are a prefix of
    the order, and the threshold is the value of its last one: every token tied with it is kept too.
    """
    vals = torch.sort(probs, dim=-1, descending=True).values
    before = torch.cumsum(vals, dim=-1, dtype=torch.float64) - vals.double()
    kept = (before <= target.double()[:, None]).sum(dim=-1).clamp_min_(1)  # [S] >= 1: the top token
    return vals.gather(-1, (kept - 1)[:, None]).squeeze(-1)


def _radix_threshold(probs: torch.Tensor, weights: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """Per row r, a threshold t such that {i : probs[r, i] >= t} is exactly the set of tokens whose
    strictly-greater tokens weigh <= target[r] in all (weights None: each token weighs 1). [R, V] -> [R].

    Radix select with no sort: non-negative float32s order like their bit patterns, so histograms over
    bits 30..20, 19..10 and 9..0 pin the threshold's bits. The first pass runs over the whole row; the
    later ones only over the tokens left in the chosen bucket. Each row's histogram sums only that row's
    values in vocabulary order, so the result never depends on batch neighbours.
    """
    R, V = probs.shape
    dev = probs.device
    bits = probs.float().contiguous().view(torch.int32)  # [R, V], non-negative
    if weights is None:
        w = torch.ones(1, dtype=torch.float32, device=dev).expand(R * V)
    else:
        w = weights.float().contiguous().view(-1)
    target = target.float()
    # level 1 over the whole rows: bits 30..20 (the exponent and 3 mantissa bits)
    key = bits >> 20
    hist = torch.zeros(R * 2048, dtype=torch.float32, device=dev)
    offs = torch.arange(0, R * 2048, 2048, dtype=torch.int32, device=dev)
    hist.index_add_(0, (key + offs[:, None]).view(-1), w)
    above_base = torch.zeros(R, dtype=torch.float32, device=dev)
    b, above_base = _pick_bucket(hist.view(R, 2048), above_base, target)
    prefix = b.to(torch.int32) << 20
    pos = torch.nonzero((key == prefix[:, None] >> 20).view(-1)).squeeze(-1)  # flat candidates
    crow = pos // V
    cbits, cw = bits.view(-1)[pos], w[pos]
    # levels 2 and 3 over the candidates left in the chosen bucket only
    for shift in (10, 0):
        ckey = (cbits >> shift) & 1023
        hist = torch.zeros(R * 1024, dtype=torch.float32, device=dev)
        hist.index_add_(0, crow * 1024 + ckey, cw)
        b, above_base = _pick_bucket(hist.view(R, 1024), above_base, target)
        prefix |= b.to(torch.int32) << shift
        keep = ckey == b[crow]
        cbits, cw, crow = cbits[keep], cw[keep], crow[keep]
    return prefix.view(torch.float32)


def _pick_bucket(
    hist: torch.Tensor, above_base: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest bucket b [R] whose strictly-higher buckets (plus `above_base`) weigh <= target, and
    that weight [R]. It is never an empty bucket other than 0 (an empty bucket qualifies only if the one
    below it does too), and an empty bucket 0 yields a threshold below every remaining candidate, which
    keeps the same set {p >= threshold}."""
    cum = torch.cumsum(hist, dim=-1)
    above = above_base[:, None] + (cum[:, -1:] - cum)  # weight strictly above each bucket
    b = torch.argmax((above <= target[:, None]).to(torch.int8), dim=-1)
    return b, above.gather(-1, b[:, None]).squeeze(-1)


def _uniforms(info: SamplingInfo, rows: list[int], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per sampled row, float64 [R, 1]: a function of (seeds[b], steps[b]) only."""
    us = [min((mix_seed(info.seeds[b], info.steps[b]) >> 10) * 2.0**-53, 1.0 - 2.0**-30) for b in rows]
    return to_device(us, torch.float64, device)[:, None]


def target_probs(processed: torch.Tensor, info: SamplingInfo, rows: list[int]) -> torch.Tensor:
    """The distributions that `sample_processed` draws rows `rows` (non-greedy rows, host indices) from:
    [len(rows), V] float32 after temperature, top-k, top-p and min-p, normalised (speculative verification
    applies its acceptance rule to exactly these)."""
    idx = to_device(rows, torch.int64, processed.device)
    probs = _filtered_probs(processed.float(), info, rows, idx)
    return probs / probs.sum(dim=-1, keepdim=True)


# Rows with top_k <= this, or top_p < 1 and no top-k: the sampler works on each row's top candidates only (CPU).
CANDIDATE_MAX_K = 256


def _candidates(logits: torch.Tensor, info: SamplingInfo, rows: list[int],
                idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows' top candidates as (probs [R, C], token ids [R, C]) in vocabulary order, after temperature,
    top-k, top-p and min-p: the same kept set and relative weights as `_filtered_probs` (so the same draw,
    up to float rounding), at the cost of one topk pass over V (and a logsumexp pass for rows without top-k)
    and work on C = kmax + 1 values (CANDIDATE_MAX_K + 1 where a row has top-p only). None (the full path) for
    a row with neither filter or top_k > CANDIDATE_MAX_K, on CUDA (whose sort path never syncs), when a row's
    tie group at its k-th value runs past the candidates (the full path keeps every tied token), or when a
    top-p-only row's nucleus is not inside its candidates."""
    V = logits.shape[-1]
    ks = [info.top_k_list[b] for b in rows]
    no_k = [i for i, k in enumerate(ks) if k >= V]
    if logits.is_cuda or any(info.top_p_list[rows[i]] >= 1.0 for i in no_k):
        return None
    kmax = max((k for k in ks if k < V), default=0)
    c = (CANDIDATE_MAX_K if no_k else kmax) + 1
    if kmax > CANDIDATE_MAX_K or c >= V:
        return None
    lg = logits[idx]
    vals, ids = torch.topk(lg, c, dim=-1)  # [R, C] descending (the logits' order is the probs')
    top_ks = info.top_ks[idx]
    has_k = (top_ks < V)[:, None]  # [R, 1]
    thr = vals.gather(-1, (top_ks.clamp(max=c) - 1)[:, None])  # [R, 1] each top-k row's k-th value
    if bool(((vals[:, c - 1:] >= thr) & has_k).any()):  # a tie at the k-th value continues past the candidates
        return None
    temps = info.temperatures[idx, None]
    x = (vals / temps).masked_fill_((vals < thr) & has_k, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [R, C], descending; cut tokens are 0
    mass = torch.ones(len(rows), dtype=torch.float32, device=logits.device)  # what top-p takes a share of
    if no_k:  # top-p over the whole vocabulary: the candidates' share of the row's softmax
        log_total = torch.logsumexp(lg / temps, dim=-1, keepdim=True)
        probs = torch.where(has_k, probs, torch.exp(x - log_total))
        share = probs[:, : c - 1].sum(dim=-1)
        # the nucleus ends before the last candidate (margin: float32 sums of the full path differ slightly)
        if bool(((share <= info.top_ps[idx] + 1e-4) & ~has_k[:, 0]).any()):
            return None
    mass = torch.where(has_k[:, 0], probs.sum(dim=-1), mass)
    if info.need_top_p:
        use = [i for i, b in enumerate(rows) if info.top_p_list[b] < 1.0]
        top_ps = info.top_ps[idx]
        probs = _cut_rows(probs, use, lambda sub, sel: _sort_threshold(sub, top_ps[sel] * mass[sel]))
    if info.need_min_p:
        probs.masked_fill_(probs < info.min_ps[idx, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    order = ids.argsort(dim=-1)  # vocabulary order, so the inverse CDF below picks what the full path would
    return probs.gather(-1, order), ids.gather(-1, order)


def sample_processed(processed: torch.Tensor, info: SamplingInfo, need_logprobs: bool = False) -> SampleOutput:
    """Sample from already processed logits [B, V] (the output of `process_logits`)."""
    next_ids = greedy_ids(processed)
    if not info.is_all_greedy:
        rows = [b for b, g in enumerate(info.greedy_rows) if not g]
        idx = to_device(rows, torch.int64, processed.device)
        cand = _candidates(processed.float(), info, rows, idx) if info.need_top_k or info.need_top_p else None
        probs, ids = cand if cand is not None else (_filtered_probs(processed.float(), info, rows, idx), None)
        # inverse CDF in vocabulary order: the first token whose cumulative mass exceeds u * total.
        # A zero-probability token never is the first (its cdf equals its predecessor's).
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        target = _uniforms(info, rows, processed.device) * cdf[:, -1:]
        choice = torch.searchsorted(cdf, target, right=True).clamp_max_(probs.shape[-1] - 1)
        next_ids[idx] = (choice if ids is None else ids.gather(-1, choice)).squeeze(-1)
    if not need_logprobs:
        return SampleOutput(next_ids, None)
    logprobs = compute_logprobs(processed).gather(-1, next_ids[:, None]).squeeze(-1)
    return SampleOutput(next_ids, logprobs)


def sample(logits: torch.Tensor, info: SamplingInfo, allowed_mask: torch.Tensor | None = None,
           need_logprobs: bool = False) -> SampleOutput:
    """One token per row of `logits` [B, V] float32. `allowed_mask` [B, V] bool: False = disallowed.
    The chosen tokens' logprobs only with `need_logprobs` (else `logprobs` is None)."""
    return sample_processed(process_logits(logits, info, allowed_mask), info, need_logprobs)
