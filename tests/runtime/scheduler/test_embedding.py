"""The embedding scheduler over a fake encoder (one component's unit test): inputs batched first come, first
served under the step's token budget, each answered in the step that embeds it, aborts of waiting inputs,
a failed forward failing only its step's inputs, and nothing held between steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.config import make_config
from runtime.messages import (
    AbortReq,
    BatchTokenizedEmbeddingReq,
    FlushCacheReq,
    GetInternalStateReq,
    TokenizedEmbeddingReq,
    TokenizedGenerateReq,
)
from runtime.sampling.params import SamplingParams
from runtime.scheduler.embedding import EmbeddingScheduler


class FakeEncoder:
    """Embeds input ids as [len, first id, sum, 1] and records each step's inputs."""

    def __init__(self) -> None:
        self.steps: list[list[list[int]]] = []
        self.fail = False

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        self.steps.append(inputs)
        if self.fail:
            raise RuntimeError("boom")
        return torch.tensor([[len(x), x[0], sum(x), 1.0] for x in inputs], dtype=torch.float32)


def _sched(max_prefill_tokens: int = 10, max_running_requests: int = 8) -> tuple[EmbeddingScheduler, FakeEncoder]:
    enc = FakeEncoder()
    cfg = make_config(max_prefill_tokens=max_prefill_tokens, max_running_requests=max_running_requests)
    return EmbeddingScheduler(enc, cfg), enc


def _req(rid: str, n: int, first: int = 1) -> TokenizedEmbeddingReq:
    return TokenizedEmbeddingReq(rid=rid, input_ids=[first] + [2] * (n - 1))


def test_steps_batch_under_the_token_budget_and_answer_every_input():
    s, enc = _sched(max_prefill_tokens=10)
    s.handle(BatchTokenizedEmbeddingReq(reqs=[_req("r0", 4, first=1), _req("r1", 4, first=2)]))  # one request
    for i, n in enumerate([4, 12, 1], start=2):
        s.handle(_req(f"r{i}", n, first=i + 1))
    outs = [s.step() for _ in range(4)]
    assert [len(x) for x in enc.steps] == [2, 1, 1, 1]  # 4+4 | 4 (+12 over) | 12 alone (over the budget) | 1
    assert [[o.rid for o in step] for step in outs] == [["r0", "r1"], ["r2"], ["r3"], ["r4"]]
    vec = np.frombuffer(outs[2][0].embedding, dtype="<f4")
    assert vec.tolist() == [12.0, 4.0, 4 + 22.0, 1.0] and outs[2][0].prompt_tokens == 12
    assert not s.has_work() and s.step() == []
    st = s.internal_state()
    assert st["forward_steps"] == 4 and st["prefill_tokens"] == 25 and st["embedded_inputs"] == 5
    assert st["num_waiting_reqs"] == 0 and st["is_embedding"] is True


def test_max_running_requests_caps_a_step():
    s, enc = _sched(max_prefill_tokens=100, max_running_requests=2)
    for i in range(5):
        s.handle(_req(f"r{i}", 1))
    while s.has_work():
        s.step()
    assert [len(x) for x in enc.steps] == [2, 2, 1]


def test_abort_drops_waiting_inputs_by_rid_prefix():
    s, enc = _sched()
    for rid in ("a_0", "a_1", "ab_0", "b_0"):
        s.handle(_req(rid, 1))
    s.handle(AbortReq(rid="a"))
    assert [r.rid for r in s.waiting] == ["ab_0", "b_0"]
    s.handle(AbortReq(abort_all=True))
    assert not s.has_work() and s.internal_state()["aborted_reqs"] == 4


def test_a_failed_forward_fails_its_step_only():
    s, enc = _sched(max_prefill_tokens=2)
    s.handle(_req("x", 2))
    s.handle(_req("y", 2))
    enc.fail = True
    bad = s.step()
    assert [(o.rid, o.embedding, "boom" in (o.error or "")) for o in bad] == [("x", b"", True)]
    enc.fail = False
    good = s.step()
    assert good[0].rid == "y" and good[0].error is None


def test_control_messages_and_refused_generation():
    s, _ = _sched()
    assert s.handle(FlushCacheReq()).success is True
    assert s.handle(GetInternalStateReq()).state["radix_cache"] is False
    with pytest.raises(ValueError, match="cannot run on an embedding model"):
        s.handle(TokenizedGenerateReq(rid="g", input_ids=[1], sampling_params=SamplingParams()))
