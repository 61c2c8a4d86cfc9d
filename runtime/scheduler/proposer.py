"""Proposers: what a speculating request guesses next. One seam, two kinds (n-gram lookup, a draft model).

The Speculator (runtime/scheduler/speculative.py) calls `propose(reqs, ks)` once per step, after decode
planning, with the decode rows that may speculate: request i gets up to ks[i] tokens guessed to follow its
fill_ids. Everything else (stop ids, grammar checks, verification) is the Speculator's and the same for both.

Life cycle of a proposer's per-request state (only the draft model keeps any: its KV):
- `propose` may compute and keep state for each request it proposes for;
- `settle(req)` runs once per proposed request in the same step, when its tokens are final for the step
  (after its verify row was processed, or at once when its proposal is not verified); the state must then
  describe only tokens the request really has;
- `release(req)` runs when the request leaves the KV pool (finish, abort, retraction: KVManager.release);
- `check(live)` is the leak check: None when the proposer's own slot accounting holds with only the `live`
  requests holding state, else a message saying what is wrong.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch

from runtime.config import SpeculativeConfig
from runtime.scheduler.core import Req
from runtime.speculative import propose_from_source, propose_ngram


class Proposal(NamedTuple):
    """`tokens`: the guesses d_1..d_m (m <= k); `q`: float32 [m, V] normalised distributions each d_i was drawn
    from (sampled requests of the draft model), or None for a deterministic guess (one-hot q)."""

    tokens: list[int]
    q: torch.Tensor | None = None


NO_PROPOSAL = Proposal([])


class Proposer(Protocol):
    def propose(self, reqs: list[Req], ks: list[int]) -> list[Proposal]: ...

    def settle(self, req: Req) -> None: ...

    def release(self, req: Req) -> None: ...

    def check(self, live: list[Req]) -> str | None: ...


class NgramProposer:
    """Prompt lookup (runtime/speculative/ngram.py) over the request's own prompt + output; stateless but for
    the prompt's array, cached on the request. A request with a predicted output (`SpecState.prediction`) looks its
    suffix up there first (its cursor `SpecState.prediction_pos` advancing with each proposal), and in its own tokens
    only when the prediction has no match."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.min_n = cfg.speculative_ngram_min_match_window_size
        self.max_n = cfg.speculative_ngram_max_match_window_size

    def propose(self, reqs: list[Req], ks: list[int]) -> list[Proposal]:
        out = []
        for req, k in zip(reqs, ks, strict=True):
            if req.spec.prompt is None:
                req.spec.prompt = np.asarray(req.origin_input_ids, dtype=np.int64)
            tokens = np.concatenate([req.spec.prompt, np.asarray(req.output_ids, dtype=np.int64)])
            guess: list[int] = []
            if req.spec.prediction is not None:
                guess, req.spec.prediction_pos = propose_from_source(req.spec.prediction, tokens, k, self.min_n,
                                                                     self.max_n, req.spec.prediction_pos)
            out.append(Proposal(guess or propose_ngram(tokens, k, self.min_n, self.max_n)))
        return out

    def settle(self, req: Req) -> None:
        return None

    def release(self, req: Req) -> None:
        return None

    def check(self, live: list[Req]) -> str | None:
        return None
