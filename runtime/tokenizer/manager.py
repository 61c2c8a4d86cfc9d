"""TokenizerManager: the asyncio front of the runtime, shared by the HTTP server and the offline Engine.

Data flow: `submit(GenerateRequest)` validates, tokenizes, expands `n` into rids f"{rid}_{i}", sends
`TokenizedGenerateReq` to the scheduler, registers a `ReqState` per rid and returns a `RequestHandle`.
`_handle_loop` receives `BatchTextOut` from the detokenizer (and control replies from the scheduler), updates
each rid's state and wakes its consumer through a per-call queue. Iterating the handle yields one state dict
per update (streaming) or per finished sample, shaped like a native /generate result plus `index` (sample
number among n).

A request is removed from `_states` when its finish arrives. A consumer that goes away (client disconnect,
cancelled task) aborts its unfinished rids at once; their states stay, marked aborted, until the
scheduler confirms with an abort finish (late outputs are dropped knowingly), or a timeout sweeps them.
All methods run on the loop thread (ZMQ sockets are not thread-safe).
Just over the 400-line soft cap: the per-rid state machine reads best in one place.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from runtime.config import Config, GrammarConfig
from runtime.constrained import validate_params
from runtime.ipc import AsyncReceiver, Endpoints, Sender
from runtime.messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTextOut,
    FinishAbort,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateOut,
    ModelInfo,
    ReqTextOut,
    TokenizedGenerateReq,
    ToScheduler,
    ToTokenizer,
)
from runtime.sampling.params import SamplingParams
from runtime.tokenizer.embedding import EmbeddingRequests
from runtime.tokenizer.generate_input import GenerateRequest, OpenAINames, RequestError, fit_context
from runtime.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class StatsSink(Protocol):
    """Where per-request timings go (server/metrics.py implements it; the Engine passes None)."""

    def on_first_token(self, ttft: float) -> None: ...
    def on_tokens(self, gap: float, num_tokens: int) -> None: ...
    def on_generated(self, num_tokens: int) -> None: ...
    def on_finish(self, e2e: float, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                  finish_type: str) -> None: ...


def check_constraint(sp: SamplingParams, grammar: GrammarConfig | str | None, names: OpenAINames | None) -> None:
    """The configured grammar backend's cheap front-end check, so a bad regex or schema (or a keyword the backend
    cannot enforce) is a 400 before anything is scheduled (the one place a request's constraint is validated
    before the scheduler compiles it). `grammar`: the server's GrammarConfig (a whitespace pattern alone means
    the default backend)."""
    try:
        validate_params(sp, grammar)
    except ValueError as e:
        code = getattr(e, "code", "invalid_value")
        if names is not None and names.constraint is not None:
            raise RequestError(f"'{names.constraint}': {e}"[:500], names.constraint, code) from None
        kind = next(k for k in ("regex", "json_schema", "ebnf", "structural_tag", "choices")
                    if getattr(sp, k) is not None)
        raise RequestError(f"{kind}: {e}"[:500], f"sampling_params.{kind}", code) from None


class ReqState:
    """One rid's accumulated output, updated by `_handle_loop`, read by its `generate` consumer."""

    sink: asyncio.Queue[ReqState] | None  # None once its consumer is gone

    def __init__(self, rid: str, index: int, sink: asyncio.Queue, req: GenerateRequest, sp: SamplingParams,
                 prompt_len: int) -> None:
        self.rid, self.index, self.sink, self.req = rid, index, sink, req
        self.text = ""
        self.output_ids: list[int] = []
        self.counts = {"prompt_tokens": prompt_len, "completion_tokens": 0, "cached_tokens": 0}
        self.num_retractions = 0
        self.spec = (0, 0, 0)  # speculative verify steps, proposed tokens accepted, proposed tokens verified
        self.finish_reason: FinishReason | None = None
        self.finished = False
        self.queued = False  # in `sink` already (several updates coalesce into one wake-up)
        self.aborted_at: float | None = None
        self.error: str | None = None  # set when the runtime failed (not the request's fault)
        self.created = time.monotonic()
        self.last_token_at: float | None = None
        self.out_lp: list[tuple[float, int]] = []
        self.out_top: list[list[tuple[float, int]] | None] = []
        self.in_lp: list[tuple[float | None, int]] | None = None
        self.in_top: list[list[tuple[float, int]] | None] | None = None
        # streamed text holds back a tail that might begin a stop string (cut at finish)
        self.stops = tuple(sp.stop) if req.stream and not sp.no_stop_trim else ()
        self.streamed = 0

    def visible_text(self) -> str:
        if self.finished or not self.stops:
            return self.text
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        self.streamed = max(self.streamed, len(self.text) - hold)
        return self.text[:self.streamed]


class RequestHandle:
    """One submitted prompt (n samples). Iterate it for result dicts; leaving early aborts what is left."""

    def __init__(self, tm: TokenizerManager, states: list[ReqState], sink: asyncio.Queue) -> None:
        self._tm, self.states, self._sink = tm, states, sink
        self.rids = [st.rid for st in states]

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        done = 0
        try:
            while done < len(self.states):
                st = await self._sink.get()
                st.queued = False
                if st.error:
                    raise RequestError(st.error, None, "server_unavailable", 503, "server_error")
                done += st.finished
                yield self._tm.result(st)
        finally:
            self.abort()

    async def finals(self) -> list[dict[str, Any]]:
        """Wait for every sample; their final results in index order (`public` form)."""
        out: list[dict[str, Any] | None] = [None] * len(self.states)
        async for item in self:
            if item["meta_info"]["finish_reason"] is not None:
                out[item["index"]] = item
        return [self.public(r) for r in out if r is not None]

    def public(self, item: dict[str, Any]) -> dict[str, Any]:
        """The native /generate shape: `index` kept only when n > 1."""
        if len(self.states) == 1:
            item = dict(item)
            item.pop("index", None)
        return item

    def abort(self) -> None:
        """Abort every sample not finished yet (idempotent)."""
        for st in self.states:
            if not st.finished:
                self._tm._abort_state(st)


class TokenizerManager:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, endpoints: Endpoints, info: ModelInfo,
                 stats: StatsSink | None = None, abort_confirm_timeout: float = 30.0) -> None:
        self.cfg, self.tokenizer, self.info, self.stats = cfg, tokenizer, info, stats
        self.context_len, self.vocab_size = info.context_len, info.vocab_size
        self._ctx = zmq.asyncio.Context()
        self._recv = AsyncReceiver(self._ctx, endpoints.tokenizer, ToTokenizer)
        self._send = Sender(self._ctx, endpoints.scheduler, ToScheduler)
        self._states: dict[str, ReqState] = {}
        self._waiters: dict[type, collections.deque[asyncio.Future]] = collections.defaultdict(collections.deque)
        self._abort_timeout = abort_confirm_timeout
        s = cfg.scheduler
        self.max_outstanding = s.max_running_requests + s.max_queued_requests
        self.failed: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.token_text = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i], False, False))
        # embedding mode's requests (runtime/tokenizer/embedding.py); on a generative model it refuses them
        self.embeddings = EmbeddingRequests(self._send, info, tokenizer, self.max_outstanding, stats)

    def start(self) -> None:
        """Start the receive loop and the abort sweeper (call on the running loop)."""
        self._tasks = [asyncio.ensure_future(self._handle_loop()), asyncio.ensure_future(self._sweep_loop())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._recv.close()
        self._send.close(linger_ms=0)
        self._ctx.term()

    # ------------------------------------------------------------ generate

    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Validate (RequestError on bad input), send the request's n samples to the scheduler, and return
        a handle to iterate. Nothing is sent when validation fails."""
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[GenerateRequest]) -> list[RequestHandle]:
        """Like `submit` for a batch: all are validated before any is sent."""
        if self.failed:
            raise RequestError(self.failed, None, "server_unavailable", 503, "server_error")
        if self.info.is_embedding:
            raise RequestError("this server serves an embedding model (--is-embedding): it does not generate; "
                               "use /v1/embeddings or /encode", None, "model_not_generative")
        prepared = [(req, *self._validate(req)) for req in reqs]
        extras = [self._extras(req) for req in reqs]
        rids_of: list[list[str]] = []
        for req, sp, _ in prepared:
            base = req.rid or uuid.uuid4().hex
            rids = [base] if sp.n == 1 else [f"{base}_{i}" for i in range(sp.n)]
            if any(r in self._states for r in rids) or any(r in done for done in rids_of for r in rids):
                raise RequestError(f"rid {base!r} is already in use", "rid")
            rids_of.append(rids)
        total = sum(len(r) for r in rids_of)
        if len(self._states) + total > self.max_outstanding:
            raise RequestError("the server is overloaded: waiting queue full, retry later", None,
                               "server_overloaded", 503, "server_error", {"Retry-After": "1"})
        return [self._send_one(req, sp, ids, rids, ex)
                for (req, sp, ids), rids, ex in zip(prepared, rids_of, extras, strict=True)]

    def _extras(self, req: GenerateRequest) -> tuple[int, list[int] | None]:
        """(priority, prediction token ids) after checking the server can honour them."""
        sched, spec = self.cfg.scheduler, self.cfg.speculative
        if req.priority is not None and not sched.enable_priority_scheduling:
            raise RequestError("'priority': priority scheduling is off (start the server with "
                               "--enable-priority-scheduling)", "priority", "unsupported_parameter")
        pred = None
        if req.prediction is not None:
            if (spec.speculative_algorithm or "none").lower() != "ngram":
                raise RequestError("'prediction': predicted outputs feed n-gram speculation (start the server with "
                                   "--speculative-algorithm ngram)", "prediction", "unsupported_parameter")
            if len(req.prediction) > 32 * self.context_len:
                raise RequestError(f"'prediction' is far longer than the context ({self.context_len} tokens)",
                                   "prediction", "context_length_exceeded")
            pred = self.tokenizer.encode(req.prediction, add_special_tokens=False) or None
        return req.priority or 0, pred

    def _send_one(self, req: GenerateRequest, sp: SamplingParams, input_ids: list[int],
                  rids: list[str], extras: tuple[int, list[int] | None] = (0, None)) -> RequestHandle:
        sink: asyncio.Queue[ReqState] = asyncio.Queue()
        states = []
        for i, rid in enumerate(rids):
            sp_i = sp if sp.n == 1 else msgspec.structs.replace(
                sp, n=1, sampling_seed=None if sp.sampling_seed is None else sp.sampling_seed + i)
            st = ReqState(rid, i, sink, req, sp, len(input_ids))
            self._states[rid] = st
            states.append(st)
            self._send.send(TokenizedGenerateReq(
                rid=rid, input_ids=input_ids, sampling_params=sp_i, return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                stream=req.stream, input_text=req.text, priority=extras[0], prediction_ids=extras[1]))
        return RequestHandle(self, states, sink)

    def _validate(self, req: GenerateRequest) -> tuple[SamplingParams, list[int]]:
        srv = self.cfg.server
        try:
            sp = SamplingParams.from_dict(req.sampling_params)
            sp.verify(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), "sampling_params") from None
        if sp.n > srv.max_n:
            raise RequestError(f"n must be at most {srv.max_n}, got {sp.n}", "sampling_params.n")
        if len(sp.stop) > srv.max_stop_strings or any(len(s) > srv.max_stop_string_len for s in sp.stop):
            raise RequestError(f"at most {srv.max_stop_strings} stop strings of at most "
                               f"{srv.max_stop_string_len} characters", "sampling_params.stop")
        if any(x is not None for x in sp.constraints):
            if self.cfg.grammar.grammar_backend == "none":
                raise RequestError("constrained decoding is off (--grammar-backend none)", "sampling_params")
            check_constraint(sp, self.cfg.grammar, req.openai)
        if not 0 <= req.top_logprobs_num <= srv.max_top_logprobs:
            raise RequestError(f"top_logprobs_num must be in [0, {srv.max_top_logprobs}]", "top_logprobs_num")
        names = req.openai
        if req.text is not None:
            if len(req.text) > 32 * self.context_len:
                raise RequestError(f"the prompt is far longer than the context ({self.context_len} tokens)",
                                   "text" if names is None else names.prompt, "context_length_exceeded")
            ids = self.tokenizer.encode(req.text)
        else:
            ids = req.input_ids or []
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"input_ids must be in [0, {self.vocab_size})", "input_ids")
        if not ids:
            raise RequestError("the prompt is empty", "text" if req.text is not None else "input_ids")
        if not -1 <= req.logprob_start_len < len(ids):
            raise RequestError(f"logprob_start_len must be in [-1, {len(ids)})", "logprob_start_len")
        requested = (req.sampling_params or {}).get("max_new_tokens")
        default = sp.max_new_tokens if names is None else names.default_max_tokens
        max_new = fit_context(self.context_len, len(ids), requested, default, names)
        if max_new != sp.max_new_tokens:
            sp = msgspec.structs.replace(sp, max_new_tokens=max_new)
        return sp, ids

    def result(self, st: ReqState) -> dict[str, Any]:
        """A native /generate result for `st` (cumulative text), plus `index`."""
        meta: dict[str, Any] = {"id": st.rid, "finish_reason": st.finish_reason, **st.counts,
                                "num_retractions": st.num_retractions}
        verify, accepted, drafted = st.spec
        if verify:  # speculative decoding ran: steps, mean tokens per verify step (accepted drafts + 1), drafts
            meta["spec_verify_ct"] = verify
            meta["spec_accept_length"] = (accepted + verify) / verify
            meta["spec_draft_tokens"], meta["spec_accepted_tokens"] = drafted, accepted
        if st.finished:
            meta["e2e_latency"] = time.monotonic() - st.created
        if st.req.return_logprob:
            text = st.req.return_text_in_logprobs
            meta["input_token_logprobs"] = self._triples(st.in_lp or [], text)
            meta["output_token_logprobs"] = self._triples(st.out_lp, text)
            if st.req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [None if t is None else self._triples(t, text) for t in st.in_top or []]
                meta["output_top_logprobs"] = [None if t is None else self._triples(t, text) for t in st.out_top]
        return {"text": st.visible_text(), "output_ids": list(st.output_ids), "meta_info": meta, "index": st.index}

    def _triples(self, pairs: list, with_text: bool) -> list[list[Any]]:
        return [[lp, tid, self.token_text(tid) if with_text else None] for lp, tid in pairs]

    # ------------------------------------------------------------ abort and control

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort `rid` and its samples `rid_i` (as the scheduler matches) or all; consumers get an abort finish."""
        self._send.send(AbortReq(rid=rid, abort_all=abort_all))
        now = time.monotonic()
        for st in self._states.values():
            if abort_all or (rid is not None and (st.rid == rid or st.rid.startswith(rid + "_"))):
                st.aborted_at = st.aborted_at or now

    def _abort_state(self, st: ReqState) -> None:
        if st.aborted_at is None:
            st.aborted_at = time.monotonic()
            self._send.send(AbortReq(rid=st.rid, message="client disconnected"))
        st.sink = None  # nobody listens any more

    async def flush_cache(self, timeout: float = 10.0) -> FlushCacheOut:
        return await self._control(FlushCacheReq(), FlushCacheOut, timeout)

    async def get_internal_state(self, timeout: float = 10.0) -> dict[str, Any]:
        out = await self._control(GetInternalStateReq(), InternalStateOut, timeout)
        return out.state

    async def _control(self, msg: Any, reply: type, timeout: float) -> Any:
        if self.failed:
            raise RequestError(self.failed, None, "server_unavailable", 503, "server_error")
        fut = asyncio.get_running_loop().create_future()
        self._waiters[reply].append(fut)
        self._send.send(msg)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise RequestError(f"the scheduler did not answer {type(msg).__name__} in {timeout:g} s", None,
                               "timeout", 503, "server_error") from None

    def fail_all(self, message: str) -> None:
        """The runtime is gone: finish every waiting request with an error, refuse new ones."""
        self.failed = message
        self.embeddings.fail_all(message)
        for st in list(self._states.values()):
            st.error = message
            self._finish(st, FinishAbort(message=message))
        self._states.clear()
        for dq in self._waiters.values():
            for fut in dq:
                if not fut.done():
                    fut.set_exception(RequestError(message, None, "server_unavailable", 503, "server_error"))
            dq.clear()

    # ------------------------------------------------------------ receive side

    async def _handle_loop(self) -> None:
        while True:
            msg = await self._recv.recv()
            try:
                if isinstance(msg, BatchTextOut):
                    for out in msg.outs:
                        self._on_text(out)
                elif isinstance(msg, BatchEmbeddingOut):
                    self.embeddings.on_batch(msg)
                else:
                    dq = self._waiters.get(type(msg))
                    while dq:
                        fut = dq.popleft()
                        if not fut.done():
                            fut.set_result(msg)
                            break
            except Exception:
                logger.exception("dropping a malformed %s", type(msg).__name__)

    def _on_text(self, out: ReqTextOut) -> None:
        st = self._states.get(out.rid)
        if st is None:
            return  # finished or swept already
        now = time.monotonic()
        if out.trim:
            st.text = st.text[:-out.trim]
        st.text += out.text_delta
        st.output_ids.extend(out.new_ids)
        st.counts["prompt_tokens"] = out.prompt_tokens or st.counts["prompt_tokens"]
        st.counts["completion_tokens"] = out.completion_tokens or len(st.output_ids)
        st.counts["cached_tokens"] = out.cached_tokens
        st.num_retractions = out.num_retractions
        st.spec = (out.spec_verify_ct, out.spec_accepted_tokens, out.spec_draft_tokens)
        if out.output_logprobs:
            st.out_lp.extend(out.output_logprobs)
            st.out_top.extend(out.output_top_logprobs or [None] * len(out.output_logprobs))
        if out.input_logprobs is not None:
            st.in_lp, st.in_top = out.input_logprobs, out.input_top_logprobs
        if out.new_ids and self.stats is not None:
            self.stats.on_generated(len(out.new_ids))
            if st.last_token_at is None:
                self.stats.on_first_token(now - st.created)
            else:
                self.stats.on_tokens(now - st.last_token_at, len(out.new_ids))
        if out.new_ids:
            st.last_token_at = now
        if out.finish_reason is not None:
            del self._states[out.rid]
            self._finish(st, out.finish_reason)
        elif st.req.stream:
            self._wake(st)

    def _finish(self, st: ReqState, reason: FinishReason) -> None:
        st.finished, st.finish_reason = True, reason
        if self.stats is not None:
            self.stats.on_finish(time.monotonic() - st.created, st.counts["prompt_tokens"],
                                 st.counts["completion_tokens"], st.counts["cached_tokens"], reason.type)
        self._wake(st)

    def _wake(self, st: ReqState) -> None:
        if st.sink is not None and not st.queued:
            st.queued = True
            st.sink.put_nowait(st)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self._abort_timeout))
            cutoff = time.monotonic() - self._abort_timeout
            for rid in [r for r, st in self._states.items() if st.aborted_at is not None and st.aborted_at < cutoff]:
                logger.warning("no abort confirmation for %s; dropping its state", rid)
                self._finish(self._states.pop(rid), FinishAbort(message="aborted (not confirmed)"))
