"""The offline Engine on SmolLM2: the same scheduler and detokenizer processes, no HTTP."""

from __future__ import annotations

import os
import time

import pytest

import runtime


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def engine():
    eng = runtime.Engine(max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_generate_single_batch_and_ids(engine):
    out = engine.generate("The capital of France is", {"max_new_tokens": 6, "temperature": 0.0})
    assert set(out) == {"text", "output_ids", "meta_info"}
    m = out["meta_info"]
    assert m["finish_reason"] is not None and m["prompt_tokens"] == 5 and m["completion_tokens"] == len(out["output_ids"])
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])
    outs = engine.generate(["Hello", "Water is"], [{"max_new_tokens": 2}, {"max_new_tokens": 0}])
    assert len(outs) == 2 and len(outs[1]["output_ids"]) == 0
    again = engine.generate(input_ids=engine.tokenizer.encode("The capital of France is"),
                            sampling_params={"max_new_tokens": 6, "temperature": 0.0})
    assert again["output_ids"] == out["output_ids"]  # greedy, and the prompt now hits the cache
    assert again["meta_info"]["cached_tokens"] >= 4


def test_stream_chunks_are_cumulative_and_early_exit_aborts(engine):
    chunks = list(engine.generate("Once upon a time", {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                                  stream=True))
    assert chunks and chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"])
    it = engine.generate("Count:", {"max_new_tokens": 1000, "ignore_eos": True}, stream=True)
    next(it)
    it.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        st = engine.get_server_info()["internal_states"][0]
        if st["num_running_reqs"] == 0:
            break
        time.sleep(0.05)
    assert st["num_running_reqs"] == 0 and st["kv_free_slots"] + st["kv_evictable_slots"] == 4096


def test_logprobs_and_bad_input(engine):
    out = engine.generate("The sky is", {"max_new_tokens": 2, "temperature": 0.0}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    m = out["meta_info"]
    assert m["input_token_logprobs"][0][0] is None and len(m["output_token_logprobs"]) == 2
    assert len(m["output_top_logprobs"][0]) == 2
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("x", {"temperature": -1})


def test_context_manager_leaves_no_processes():
    os.environ["RADIXGEN_SCHEDULER_FACTORY"] = "tests.server.fake_scheduler:create"
    try:
        with runtime.Engine() as eng:
            pids = [p for p in eng._launch.group.pids.values() if p]
            assert eng.generate("a b c", {"max_new_tokens": 3})["text"] == "a b c"
    finally:
        del os.environ["RADIXGEN_SCHEDULER_FACTORY"]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    with pytest.raises(RuntimeError):
        eng.generate("a")
