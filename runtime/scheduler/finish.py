"""Finish checks after a request appends a token in SGLang's order:

length (`len(output_ids) >= max_new_tokens`) -> grammar terminated -> EOS / stop_token_ids (unless
ignore_eos) -> stop strings and stop regexes on the decoded output tail. Nothing but length ends a request
before `min_new_tokens` (the sampler also masks stop ids until then). A JSON answer whose last tokens the
closing window narrowed (`req.grammar_state.budget_closed`, runtime/constrained/closing.py) finishes `length` when its grammar
ends: the budget, not the model, ended it.

Stop strings are matched on the decoded text of the last few output tokens (`tail_tokens`): a stop string
of c characters spans at most c + 1 tokens (a token decodes to at least one character, a partial UTF-8 one
to a replacement character), so decoding c + 2 tokens always covers a match that ends in the newest token.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from runtime.messages import FinishLength, FinishStop
from runtime.scheduler.core import Req

REGEX_TAIL_TOKENS = 64  # decoded tail for stop_regex (its match length is unbounded)


def tail_tokens(req: Req) -> int:
    p = req.sampling_params
    n = max((len(s) for s in p.stop), default=0) + 2 if p.stop else 0
    return max(n, REGEX_TAIL_TOKENS) if p.stop_regex else n


def check_finished(req: Req, eos_ids: frozenset[int], decode_fn: Callable[[list[int]], str] | None) -> None:
    """Set `req.finish_reason` (and `req.stop_trim` for a matched stop string) when the request is done."""
    p = req.sampling_params
    n = len(req.output_ids)
    if n >= p.max_new_tokens:
        req.finish_reason = FinishLength(length=p.max_new_tokens)
        return
    last = req.output_ids[-1]
    if req.grammar is not None and req.grammar.is_terminated():
        # Ended on EOS: a matched stop token (the detokenizer trims it). Ended because the grammar admits no
        # continuation: the last token is content, so nothing is "matched" and it stays in the text.
        req.finish_reason = FinishStop(matched=last if last in eos_ids else None)
        if req.grammar_state.budget_closed:  # the budget, not the model, ended the document: report it (constrained/closing.py);
            # an ending EOS stays "matched" so the detokenizer still trims it
            req.finish_reason = FinishLength(length=p.max_new_tokens, matched=last if last in eos_ids else None)
        return
    if n < p.min_new_tokens:
        return
    if not p.ignore_eos and (last in eos_ids or last in p.stop_token_ids):
        req.finish_reason = FinishStop(matched=last)
        return
    k = tail_tokens(req)
    if not k or decode_fn is None:
        return
    tail = decode_fn(req.output_ids[-k:])
    for s in p.stop:
        if s in tail:
            req.finish_reason, req.stop_trim = FinishStop(matched=s), s
            return
    for pattern in p.stop_regex:
        m = re.search(pattern, tail)
        if m is not None:
            req.finish_reason, req.stop_trim = FinishStop(matched=m.group(0)), m.group(0)
            return
