"""Request state: `SamplingParams`, `Req` and `Batch`, the one home of a request's length vocabulary.

Data flow: the scheduler builds a `Req` from each `TokenizedGenerateReq`, moves it between its queues
(grammar -> waiting -> running, and back to waiting on retraction), groups running requests into a `Batch`
per step, and hands the model runner the immutable `ForwardBatch` view built here.

Lengths of a request (all positions index `fill_ids = origin_input_ids + output_ids`):
- `cached_len`: positions [0, cached_len) have K/V in the pool, reached through `row` of the table.
- `tree_len`:   positions [0, tree_len) are slots owned by the radix tree, locked through `last_node`
                (tree_len <= seq_len: a planned extend enters the tree before its forward, for same-step
                sharing; the rest of the row's slots belong to the request).
- `extend_len`: tokens computed in the current step (prefill chunk, 1 in decode, 1 + forced tokens after a
                jump-forward, 1 + len(draft_ids) in a speculative verify row).
- `seq_len`:    cached_len + extend_len, the sequence length after the current step.
- `fill_len`:   len(fill_ids); fill_len - cached_len is what the next step computes.
A running request's KV lags its tokens by one (the last sampled token is the next step's input), or by more
after a jump-forward appended grammar-forced tokens (they ride in the next step as an extend row).
Speculative drafts (`spec.draft_ids`) are not tokens of the request: a verify row computes its last token plus the
drafts (extend_len = 1 + len(spec.draft_ids), so seq_len may pass fill_len during that step only); after the
forward the processor keeps the KV of the accepted ones and frees the rest (runtime/scheduler/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radix_cache import TreeNode
from runtime.constrained.closing import window
from runtime.constrained.seam import CompileFuture, Grammar
from runtime.executor.forward_batch import ForwardBatch
from runtime.messages import FinishReason
from runtime.sampling.params import SamplingParams

__all__ = ["Batch", "GrammarState", "LogprobState", "Req", "SamplingParams", "SpecState"]



@dataclass(slots=True)
class LogprobState:
    """What a request asked for in logprobs, and those computed but not yet reported."""

    wanted: bool = False  # return_logprob
    start_len: int = -1  # prompt positions start_len.. get logprobs (-1: none)
    top_num: int = 0  # top-k alternatives per position (0: none)
    out: list[tuple[float, int]] = field(default_factory=list)  # (logprob, token) pending since the last report
    out_top: list[list[tuple[float, int]]] = field(default_factory=list)
    inputs: list[tuple[float | None, int]] = field(default_factory=list)  # prompt logprobs (first: None)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    inputs_sent: bool = False  # prompt logprobs go out once, with the first report after the prefill


@dataclass(slots=True)
class GrammarState:
    """A constrained request's bookkeeping around its grammar (runtime/constrained/seam.py)."""

    future: CompileFuture | None = None  # the compile it waits on in the grammar queue
    wait_since: float = 0.0  # when it entered the grammar queue (time.monotonic)
    budget_closed: bool = False  # the closing window narrowed its choices (runtime/constrained/closing.py)
    jump_tokens: int = 0  # tokens the last jump-forward appended (computed next step as an extend row)


@dataclass(slots=True)
class SpecState:
    """Speculative decoding state (runtime/scheduler/speculative.py).

    `draft_ids`: this step's proposed tokens (empty outside a verify step); `draft_q`: the distributions they
    were drawn from (float32 [len(draft_ids), V]; None: a deterministic proposal, one-hot); `draft_bitmask`: the
    grammar's allowed-token bitmask per verify position (int32 [len(draft_ids) + 1, W]; None: unconstrained);
    `prompt`: the n-gram proposer's cached prompt array; `prediction`: the request's predicted output (int64, the
    n-gram proposer's first source; None without one) and `prediction_pos` its cursor there. Adaptive pause (`pause_after_verify`): `accept_avg` is
    the moving average of drafts accepted per verify step (meaningful once verify_ct > 0), `pause` the decode
    steps left in which it proposes nothing, `pause_len` its latest pause (0: none since the average recovered).
    """

    draft_ids: list[int] = field(default_factory=list)
    draft_q: torch.Tensor | None = None
    draft_bitmask: torch.Tensor | None = None
    prompt: np.ndarray | None = None
    prediction: np.ndarray | None = None
    prediction_pos: int = 0
    verify_ct: int = 0
    accepted: int = 0  # drafts accepted over all verify steps
    drafted: int = 0  # drafts verified over all verify steps
    accept_avg: float = 0.0
    pause: int = 0
    pause_len: int = 0


class Req:
    """One generation request and everything the scheduler tracks about it."""

    def __init__(
        self, rid: str, input_ids: list[int], params: SamplingParams, *, arrival: int = 0,
        return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0, priority: int = 0,
    ) -> None:
        self.rid = rid
        self.priority = priority  # --enable-priority-scheduling (runtime/scheduler/policy.py)
        self.origin_input_ids = list(input_ids)
        self.sampling_params = params
        self.arrival = arrival  # arrival order, kept across retraction (fcfs and tie-breaks)
        self.seed = params.sampling_seed if params.sampling_seed is not None else 0  # set by the scheduler
        self.logprobs = LogprobState(return_logprob, logprob_start_len if return_logprob else -1,
                                     top_logprobs_num if return_logprob else 0)
        self.output_ids: list[int] = []
        # KV bookkeeping (see the module docstring); row is None while the request is not admitted.
        self.row: int | None = None
        self.last_node: TreeNode | None = None
        self.tree_len = 0
        self.cached_len = 0
        self.extend_len = 0
        # Finishing and reporting.
        self.finish_reason: FinishReason | None = None
        self.stop_trim: str | None = None
        self.cached_tokens = 0  # prompt tokens served by the cache at first admission
        self.admitted = False  # admitted at least once (cached_tokens is then final)
        self.prefilled = False  # the first full prefill is done (prompt logprobs are then final)
        self.num_retractions = 0
        self.sent_len = 0  # output_ids[:sent_len] already reported
        # Constrained decoding (runtime/constrained/seam.py): its own grammar state once compiled, and the rest.
        self.grammar: Grammar | None = None
        self.grammar_state = GrammarState()
        self.spec = SpecState()

    # ---- lengths ----------------------------------------------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        """Every token known so far: prompt plus output."""
        return self.origin_input_ids + self.output_ids

    def step_ids(self) -> list[int]:
        """The tokens this step computes: fill_ids[cached_len : seq_len], the drafts standing in for the
        positions past fill_len in a verify row."""
        if not self.spec.draft_ids:
            return self.token_slice(self.cached_len, self.seq_len)
        return self.token_slice(self.cached_len, self.seq_len - len(self.spec.draft_ids)) + self.spec.draft_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (a decode row reads one token of a long sequence)."""
        p = len(self.origin_input_ids)
        if end <= p:
            return self.origin_input_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.origin_input_ids[start:] + self.output_ids[: end - p]

    @property
    def row_index(self) -> int:
        """Its row of the request-to-token table; only an admitted request has one."""
        if self.row is None:
            raise RuntimeError(f"request {self.rid} has no table row (not admitted)")
        return self.row

    @property
    def fill_len(self) -> int:
        """len(fill_ids), without building the list."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def seq_len(self) -> int:
        return self.cached_len + self.extend_len

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens

    @property
    def remaining_new_tokens(self) -> int:
        """Output tokens it may still produce (retraction keeps what it already produced)."""
        return max(self.max_new_tokens - len(self.output_ids), 0)

    def closes_within(self, reserve: int, ahead: int = 0) -> bool:
        """A JSON-schema request whose token after the next `ahead` falls in its closing window
        (`--json-close-reserve`, runtime/constrained/closing.py)."""
        return bool(reserve) and self.grammar is not None and self.sampling_params.json_schema is not None and (
            self.remaining_new_tokens - ahead <= window(self.max_new_tokens, reserve)) and (
            self.grammar.free_prefix is not None)  # not while a thinking model still thinks

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprobs.start_len >= 0 and not self.prefilled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def match_cap(self) -> int:
        """Longest prefix the cache may serve: at least one token must be computed (its logits sample the
        next token), and prompt logprobs from `logprob_start_len` need their positions' logits computed."""
        cap = len(self.origin_input_ids) + len(self.output_ids) - 1
        if self.wants_input_logprobs:
            cap = min(cap, max(self.logprobs.start_len - 1, 0))
        return max(cap, 0)

    def __repr__(self) -> str:
        return (f"Req({self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, "
                f"cached={self.cached_len}, tree={self.tree_len}, row={self.row})")


class Batch:
    """The requests of one step and the new tokens each computes.

    Rows [0, num_decode) are decode rows (running requests, one new token each); rows [num_decode, size) are
    extend rows (prompt chunks, readmissions, jump-forward extends of running requests, speculative verify
    rows: the last token plus the drafts, a logit per position). A mixed step carries
    both in one forward. `reqs[b]` computes `fill_ids[cached_len : cached_len + extend_len]` into slots
    `out_cache_loc` (concatenated in row order). `logit_offsets[b]` lists positions (relative to the request's
    first new token) whose logits come back; the last offset of a request that samples this step is
    `extend_len - 1`.
    """

    def __init__(self, reqs: list[Req], num_decode: int, out_cache_loc: torch.Tensor,
                 logit_offsets: list[list[int]]) -> None:
        self.reqs = reqs
        self.num_decode = num_decode
        self.out_cache_loc = out_cache_loc
        self.logit_offsets = logit_offsets
        # logits row span of each request in the runner's output: rows[b] = (start, count)
        self.logit_rows: list[tuple[int, int]] = []
        acc = 0
        for offs in logit_offsets:
            self.logit_rows.append((acc, len(offs)))
            acc += len(offs)

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def is_decode(self) -> bool:
        """Every row is a decode row."""
        return self.num_decode == len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.reqs)

    @property
    def extend_tokens(self) -> int:
        """New tokens of the extend rows (the step's prefill work; speculative verify rows excluded)."""
        return sum(r.extend_len for r in self.reqs[self.num_decode :] if not r.spec.draft_ids)

    @property
    def draft_tokens(self) -> int:
        """Proposed tokens verified in this step."""
        return sum(len(r.spec.draft_ids) for r in self.reqs[self.num_decode :])

    def forward_batch(self) -> ForwardBatch:
        """Immutable tensor view for the runner (the table rows were already written by the scheduler)."""
        ids: list[list[int]] = []
        indices: list[int] = []
        start = 0
        for req, offs in zip(self.reqs, self.logit_offsets, strict=True):
            ids.append(req.step_ids())
            indices.extend(start + o for o in offs)
            start += req.extend_len
        return ForwardBatch.build(
            input_ids=ids,
            prefix_lens=[r.cached_len for r in self.reqs],
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=[r.row_index for r in self.reqs],
            num_decode=self.num_decode,
            logits_indices=indices,
        )
