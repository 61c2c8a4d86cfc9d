"""A model-free scheduler for plumbing tests (selected with RADIXGEN_SCHEDULER_FACTORY).

It echoes: output token k of a request is its prompt token k mod prompt length, so a request whose
max_new_tokens equals its prompt length outputs its own prompt. It keeps a slot pool like the real one
(prompt + max_new_tokens slots held while running), steps every few milliseconds, honours abort (rid
prefix), flush, internal state and `max_new_tokens: 0`. Prompt token 0 decodes one token then stops
(what /health_generate sends).
"""

from __future__ import annotations

import time
from typing import Any

from runtime.config import Config
from runtime.messages import (
    AbortReq,
    FinishAbort,
    FinishLength,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateReq,
    InternalStateOut,
    ModelInfo,
    ReqTokenOut,
    TokenizedGenerateReq,
)

TOTAL_SLOTS = 4096
STEP_SECONDS = 0.004


class _Req:
    def __init__(self, msg: TokenizedGenerateReq) -> None:
        self.msg = msg
        self.out: list[int] = []
        self.sent = 0
        self.slots = len(msg.input_ids) + msg.sampling_params.max_new_tokens


class FakeScheduler:
    """Implements runtime/scheduler/process.py's LoopScheduler; its step batch is the list of running requests."""

    grammar_backend = None

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.last_forward: tuple[bool, float] | None = None
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.free = TOTAL_SLOTS
        self._outs: list[ReqTokenOut] = []

    def handle(self, msg: Any) -> Any:
        if isinstance(msg, TokenizedGenerateReq):
            if msg.input_ids == [13, 13, 13]:  # a request that makes handle() raise (per-request error test)
                raise RuntimeError("boom")
            self.waiting.append(_Req(msg))
        elif isinstance(msg, AbortReq):
            for q in (self.waiting, self.running):
                for r in [r for r in q if msg.abort_all or (msg.rid and r.msg.rid.startswith(msg.rid))]:
                    q.remove(r)
                    if q is self.running:
                        self.free += r.slots
                    self._emit(r, FinishAbort(message=msg.message))
        elif isinstance(msg, FlushCacheReq):
            return FlushCacheOut(success=not self.has_work())
        elif isinstance(msg, GetInternalStateReq):
            return InternalStateOut(state=self.internal_state())
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[ReqTokenOut]:
        batch = self.begin_step()
        if batch is not None:
            self.forward(batch)
        return self.end_step(batch, None)

    def begin_step(self) -> list[_Req] | None:
        while self.waiting and self.waiting[0].slots <= self.free:
            r = self.waiting.pop(0)
            self.free -= r.slots
            self.running.append(r)
        return list(self.running) or None

    def forward(self, batch: list[_Req]) -> None:
        time.sleep(STEP_SECONDS)

    def end_step(self, batch: list[_Req] | None, logits: object) -> list[ReqTokenOut]:
        for r in batch or []:
            sp = r.msg.sampling_params
            limit = 1 if r.msg.input_ids == [0] else sp.max_new_tokens
            if len(r.out) < limit:
                ids = r.msg.input_ids
                r.out.append(ids[len(r.out) % len(ids)])
            if len(r.out) >= limit:
                self.running.remove(r)
                self.free += r.slots
                self._emit(r, FinishLength(length=limit))
            elif r.msg.stream:
                self._emit(r, None)
        outs, self._outs = self._outs, []
        return outs

    def _emit(self, r: _Req, finish: FinishReason | None) -> None:
        new, r.sent = r.out[r.sent:], len(r.out)
        sp = r.msg.sampling_params
        self._outs.append(ReqTokenOut(
            rid=r.msg.rid, new_ids=new, finish_reason=finish, prompt_tokens=len(r.msg.input_ids),
            completion_tokens=len(r.out), skip_special_tokens=sp.skip_special_tokens,
            output_logprobs=[(-0.5, t) for t in new] if r.msg.return_logprob else None))

    def internal_state(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "num_waiting_tokens": sum(len(r.msg.input_ids) for r in self.waiting),
                "max_total_num_tokens": TOTAL_SLOTS, "kv_free_slots": self.free, "kv_evictable_slots": 0,
                "kv_locked_slots": 0, "cache_hit_rate": 0.0, "num_retracted_reqs": 0}

    def check_memory(self, strict: bool = False) -> bool:
        return True


def create(cfg: Config) -> tuple[FakeScheduler, ModelInfo]:
    return FakeScheduler(cfg), ModelInfo(context_len=2048, vocab_size=49152, max_total_num_tokens=TOTAL_SLOTS)


def create_broken(cfg: Config) -> tuple[FakeScheduler, ModelInfo]:
    raise RuntimeError("no model here")
