"""The scheduler on the real SmolLM2 model (CPU, float32), driven in-process through handle/step.

Each test builds a Scheduler over the session's model runner and leaves the pool as it found it (the cache
is flushed at the end), so the shared runner stays clean for other tests.
"""

from __future__ import annotations

import pytest

from runtime.executor.memory import SlotAllocator
from tests.runtime.scheduler.driver import Driver, chat, generate


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer








QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Which planet is closest to the sun?"]


@pytest.fixture(scope="module")
def prompts(tok) -> dict[str, list[int]]:
    return {f"q{i}": chat(tok, q) for i, q in enumerate(QUESTIONS)}


@pytest.fixture(scope="module")
def no_cache_outputs(smollm_runner, tok, prompts) -> dict[str, list[int]]:
    """The reference: all prompts in one batch, radix cache off."""
    return generate(smollm_runner, tok, prompts, disable_radix_cache=True)[0]


def test_greedy_identical_with_cache_on_off_and_across_batch_mixes(smollm_runner, tok, prompts, no_cache_outputs):
    assert "Paris" in tok.decode(no_cache_outputs["q0"])
    # q0 alone first; then all three (q0 again as "again"), chunked, with q0's prompt + output in the tree.
    both = dict(prompts, again=prompts["q0"])
    mixed, d = generate(smollm_runner, tok, both, waves=[["q0"], ["q2", "again", "q1"]], chunked_prefill_size=16)
    assert mixed["again"] == mixed["q0"]
    del mixed["again"]
    assert mixed == no_cache_outputs
    assert d.final("again").cached_tokens == len(prompts["q0"]) - 1
    assert d.final("q1").cached_tokens >= 15  # the shared system prompt


def test_second_request_sharing_a_300_token_prefix_hits(smollm_runner, tok):
    doc = " ".join(f"Fact {i}: the radix tree stores shared token prefixes once." for i in range(30))
    first = chat(tok, "Summarize the facts.", system=doc)
    second = chat(tok, "How many facts are there?", system=doc)
    d = Driver(smollm_runner, tok)
    try:
        d.submit("a", first, 1)
        d.run()
        d.submit("b", second, 1)
        d.run()
        assert d.final("a").cached_tokens == 0
        assert d.final("b").cached_tokens >= 300
        assert d.sched.internal_state()["cache_hit_rate"] > 0.4
    finally:
        d.close()


def test_chat_turn_two_hits_turn_one_prompt_and_answer(smollm_runner, tok):
    msgs = [{"role": "user", "content": "Tell me a fun fact about octopuses."}]
    turn1 = tok.encode_chat(msgs)
    d = Driver(smollm_runner, tok)
    try:
        d.submit("t1", turn1, 8)
        d.run()
        answer = d.ids("t1")
        msgs += [{"role": "assistant", "content": tok.decode(answer)}, {"role": "user", "content": "Another one?"}]
        turn2 = tok.encode_chat(msgs)
        d.submit("t2", turn2, 1)
        d.run()
        cached = d.final("t2").cached_tokens
        assert cached >= len(turn1) + len(answer) - 3, (cached, len(turn1), len(answer))
    finally:
        d.close()


def test_tiny_pool_forces_retraction_with_identical_greedy_outputs(smollm_runner, tok, prompts, no_cache_outputs):
    # Room for the prompts and 4 decode steps of all three: decode must retract, outputs must not change.
    ps = list(prompts.values())
    common = next(i for i in range(len(ps[0])) if len({p[i] for p in ps}) > 1)  # shared system prompt
    small = SlotAllocator(sum(map(len, ps)) - (len(ps) - 1) * common + 12, strict=True)
    tight, d = generate(smollm_runner, tok, prompts, allocator=small, schedule_conservativeness=0.05)
    assert d.sched.internal_state()["num_retracted_reqs"] > 0
    assert tight == no_cache_outputs


def test_seeds_reproduce_whatever_the_batch(smollm_runner, tok):
    ids = chat(tok, "Write a word.")
    d = Driver(smollm_runner, tok)
    try:
        d.submit("alone", ids, 6, temperature=1.0, sampling_seed=7, ignore_eos=True)
        d.run()
        d.submit("mixed", ids, 6, temperature=1.0, sampling_seed=7, ignore_eos=True)
        d.submit("other", chat(tok, "Count to three."), 6, temperature=1.0, sampling_seed=3, ignore_eos=True)
        d.submit("seed8", ids, 6, temperature=1.0, sampling_seed=8, ignore_eos=True)
        d.run()
        assert d.ids("alone") == d.ids("mixed")
        assert d.ids("seed8") != d.ids("alone")
    finally:
        d.close()


def test_shared_prefix_cascade_decode_equals_uncached(smollm_runner, tok, monkeypatch):
    """Requests that hit one cached ~400-token prefix share its KV slots, so their decode batches take the
    shared-prefix path of the runner's backend (prefix read once for the batch: the native cpu backend's
    shared_len, the torch backend's cascade); greedy outputs equal a radix-off run (no shared slots)."""
    import kernels.torch_backend as tb
    from kernels.cpu.backend import CpuAttnBackend

    doc = " ".join(f"Depot {i} holds {7 * i + 3} crates of copper wire, checked by Mara." for i in range(24))
    questions = ["How many crates in depot 3?", "Who checks the depots?", "What is stored in depot 5?",
                 "Which depot holds 59 crates?", "Is depot 9 checked?", "Name two depots.", "Who is Mara?"]
    # six rows x 3 query heads per KV head = 18 >= 16: the native backend's brgemm shared pass, not the row kernel
    prompts = {f"r{i}": chat(tok, q, system=doc) for i, q in enumerate(questions)}
    plain, _ = generate(smollm_runner, tok, prompts, max_new=12, disable_radix_cache=True)
    calls = []
    attn = smollm_runner.attn
    if isinstance(attn, CpuAttnBackend):
        real_plan = attn._plan_decode

        def plan(m):
            part = real_plan(m)
            if part.shared_len > 0 and m.batch_size > 1:
                calls.append(m.num_decode)
            return part

        monkeypatch.setattr(attn, "_plan_decode", plan)
    else:
        real = tb.cascade_decode_attention
        monkeypatch.setattr(tb, "cascade_decode_attention", lambda *a: calls.append(1) or real(*a))
    cached, _ = generate(smollm_runner, tok, prompts, max_new=12, waves=[["r0"], [f"r{i}" for i in range(1, 7)]])
    assert calls, "the shared-prefix path was not taken"
    assert not isinstance(attn, CpuAttnBackend) or max(calls) >= 6, "no decode step of 6 rows shared the prefix"
    assert cached == plain


def test_mixed_steps_give_the_greedy_outputs_of_separated_steps(smollm_runner, tok, prompts, no_cache_outputs):
    """Requests arriving while another decodes, chunked by 16 tokens: one forward carrying decode rows and
    extend rows gives the same greedy tokens (float32) as separated prefill and decode steps."""
    outs, stalls = {}, {}
    for mixed in (True, False):
        d = Driver(smollm_runner, tok, chunked_prefill_size=16, disable_mixed_steps=not mixed)
        try:
            d.submit("q0", prompts["q0"], 8, ignore_eos=True)
            for _ in range(3):
                d.step()
            for rid in ("q1", "q2"):
                d.submit(rid, prompts[rid], 8, ignore_eos=True)
            d.run()
            outs[mixed] = {rid: d.ids(rid) for rid in prompts}
            st = d.sched.internal_state()
            stalls[mixed] = st["stall_steps"]
            assert (st["mixed_steps"] > 0) == mixed
        finally:
            d.close()
    assert outs[True] == outs[False] == no_cache_outputs
    assert stalls[True] == 0 < stalls[False]
