"""The scheduler on a real model runner, driven in-process through handle/step, for tests.

`Driver` submits requests, steps until idle and collects outputs per rid; it leaves the pool as it found it
(`close` asserts no slot is locked and flushes the cache), so a shared runner stays clean between tests.
"""

from __future__ import annotations

import json
import time

from runtime.config import make_config
from runtime.messages import TokenizedGenerateReq
from runtime.sampling.params import SamplingParams
from runtime.scheduler import Scheduler

SYSTEM = "You are a concise assistant. Answer in one short sentence."


def chat(tok, question: str, system: str = SYSTEM) -> list[int]:
    return tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])


class Driver:
    """A tiny in-test serving loop: submit requests, step until idle, collect outputs per rid."""

    def __init__(self, runner, tok, allocator=None, grammar_backend=None, draft_runner=None, hicache=None,
                 **cfg) -> None:
        self.runner = runner
        alloc = allocator or runner.allocator
        config = make_config(max_total_tokens=alloc.num_slots, strict_memory_check=True,
                             max_running_requests=runner.req_to_token.size, **cfg)
        self.sched = Scheduler(runner, alloc, runner.req_to_token, config, runner.eos_token_ids,
                               tok.decode if tok is not None else None, grammar_backend, draft_runner=draft_runner,
                               hicache=hicache)
        self.outs: dict[str, list] = {}

    def submit(self, rid: str, ids: list[int], max_new: int = 16, **params) -> None:
        params.setdefault("temperature", 0.0)
        sp = SamplingParams(max_new_tokens=max_new, **params)
        self.sched.handle(TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=sp))

    def step(self) -> None:
        for o in self.sched.step():
            self.outs.setdefault(o.rid, []).append(o)

    def run(self) -> None:
        for _ in range(5000):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.has_work()
        self.sched.step()  # idle step: the strict memory check
        assert self.sched.check_memory(strict=True)

    def ids(self, rid: str) -> list[int]:
        return [t for o in self.outs[rid] for t in o.new_ids]

    def final(self, rid: str):
        return self.outs[rid][-1]

    def close(self) -> None:
        st = self.sched.internal_state()
        assert st["kv_locked_slots"] == 0
        assert st["kv_free_slots"] + st["kv_evictable_slots"] == st["max_total_num_tokens"]
        assert self.sched.flush_cache().success


def generate(runner, tok, prompts: dict[str, list[int]], max_new: int = 8, allocator=None,
             waves: list[list[str]] | None = None, **cfg) -> tuple[dict[str, list[int]], Driver]:
    """Greedy outputs (ignore_eos, so lengths are fixed); `waves`: rid groups submitted one after another."""
    d = Driver(runner, tok, allocator, **cfg)
    try:
        for wave in waves or [list(prompts)]:
            for rid in wave:
                d.submit(rid, prompts[rid], max_new, ignore_eos=True)
            d.run()
        return {rid: d.ids(rid) for rid in prompts}, d
    finally:
        d.close()


def person_schema_backend(tok):
    """A one-worker grammar backend with the {name, age} object schema already compiled (and cached), so the
    runs that follow never wait on it; returns (backend, schema). The caller closes the backend."""
    from runtime.config import GrammarConfig
    from runtime.constrained import GrammarBackend

    be = GrammarBackend.from_tokenizer(tok, GrammarConfig(grammar_compile_timeout=60.0), num_workers=1)
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                         "required": ["name", "age"]})
    fut = be.get_future(SamplingParams(json_schema=schema))
    for _ in range(600):
        if fut.done():
            break
        time.sleep(0.1)
    fut.result()
    return be, schema
