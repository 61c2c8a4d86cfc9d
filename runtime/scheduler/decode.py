"""Decode planning: the next tokens of every running request, evicting the cache and then retracting when short.

A running request computes `fill_len - cached_len` tokens per step: 1 (a decode row), or 1 plus the tokens a
jump-forward appended (an extend row of the same step, so a grammar-forced continuation never costs its
request a step). When free + evictable slots cannot cover the next few steps of every running request,
requests are retracted back to the waiting queue, fewest output tokens first (ties: longest prompt first),
until they can. A retracted request's computed KV (prompt plus output so far) goes into the tree unlocked, so
its readmission is mostly a cache hit; it keeps `output_ids`. A request that cannot decode even alone is
aborted (the pool is too small for it): the scheduler never crashes on a full pool.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.scheduler.cache import KVManager
from runtime.scheduler.core import Req

RETRACT_DECODE_STEPS = 20  # retract until every remaining request has room for this many steps


class DecodePlan(NamedTuple):
    """`decode`: rows with one new token; `extend`: running rows with forced tokens to compute too; `slots`:
    their new slots, decode rows first then extend rows (row order); `retracted` / `aborted`: removed from
    the running list."""

    decode: list[Req]
    extend: list[Req]
    slots: list[torch.Tensor]
    retracted: list[Req]
    aborted: list[tuple[Req, str]]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(r.extend_len for r in self.extend)


def _need(req: Req) -> int:
    return req.fill_len - req.cached_len


def _room_needed(reqs: list[Req]) -> int:
    return sum(max(min(r.remaining_new_tokens, RETRACT_DECODE_STEPS), _need(r), 1) for r in reqs)


def plan_decode(kv: KVManager, running: list[Req], others_hold_slots: bool = False) -> DecodePlan:
    """Plan one decode step over `running` (which it shrinks in place by the retracted/aborted ones).
    `others_hold_slots`: a chunked prefill holds slots too, so a lone request that cannot decode is
    retracted (to wait for them) rather than aborted."""
    retracted: list[Req] = []
    aborted: list[tuple[Req, str]] = []
    if kv.available() < sum(_need(r) for r in running):
        # Victims in pop order: the request with the fewest output tokens (then the longest prompt) last.
        victims = sorted(running, key=lambda r: (len(r.output_ids), -r.prompt_len), reverse=True)
        while len(victims) > 1 and kv.available() < _room_needed(victims):
            req = victims.pop()
            kv.release(req)
            req.num_retractions += 1
            retracted.append(req)
        if victims and kv.available() < sum(_need(r) for r in victims):
            req = victims.pop()
            kv.release(req)
            if others_hold_slots:
                req.num_retractions += 1
                retracted.append(req)
            else:
                aborted.append((req, f"KV cache pool ({kv.total} slots) is too small for this request"))
        keep = {id(r) for r in victims}
        running[:] = [r for r in running if id(r) in keep]
    decode: list[Req] = []
    extend: list[Req] = []
    for req in running:
        (decode if _need(req) == 1 else extend).append(req)
    # one allocation and one table scatter for all decode rows; `slots` stays one [1] view per row
    both = kv.extend_one_each(decode) if decode else None
    slots = [*both.split(1)] if both is not None else []
    slots += [kv.extend(r, _need(r)) for r in extend]
    assert len(slots) == len(decode) + len(extend) and all(s is not None for s in slots), "checked above"
    return DecodePlan(decode, extend, slots, retracted, aborted)


def retract_ratio(running: list[Req]) -> float:
    """new_token_ratio estimate after a retraction: the share of max_new_tokens the survivors will use."""
    done = sum(len(r.output_ids) for r in running)
    total = sum(r.max_new_tokens for r in running) or 1
    return min(1.0, (done + RETRACT_DECODE_STEPS * len(running)) / total)
