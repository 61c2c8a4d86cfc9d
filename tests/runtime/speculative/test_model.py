"""Speculative decoding on the real SmolLM2 (CPU, float32): greedy output with speculation equals without,
token for token, over 30 prompts in one mixed batch (quoting, code copying, free chat), and constrained
requests stay valid. Uses the session runner; every run ends with the strict leak check (Driver.run/close).
"""

from __future__ import annotations

import json

import pytest

from tests.runtime.scheduler.driver import Driver, chat, person_schema_backend

MAX_NEW = 16
SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
FACTS = ["The bridge opened in 1932 and carries eight lanes.", "Copper wire conducts heat as well as current.",
         "The library closes at nine on weekdays.", "Owls can turn their heads about 270 degrees.",
         "The recipe needs two eggs and a cup of flour.", "Mount Rainier is a volcano in Washington."]
CODE = "def add(a, b):\n    total = a + b\n    return total\n\ndef mul(a, b):\n    return a * b\n"
CHAT = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?", "Tell me a joke.",
        "What is 12 times 7?", "Give me a word that rhymes with cat.", "What do bees make?",
        "How many legs does a spider have?", "Who wrote Hamlet?", "What is water made of?"]


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


@pytest.fixture(scope="module")
def prompts(tok) -> dict[str, list[int]]:
    out = {}
    for i in range(10):
        doc = " ".join(FACTS[i % 6 :] + FACTS[: i % 6])
        out[f"rag{i}"] = chat(tok, f"Quote the sentence about {['the bridge', 'copper', 'the library', 'owls', 'the recipe', 'Mount Rainier'][i % 6]} exactly.", system=doc)
    for i in range(10):
        out[f"code{i}"] = chat(tok, f"Rename the function {'add' if i % 2 else 'mul'} to f{i} and repeat the code:\n{CODE}")
    for i, q in enumerate(CHAT):
        out[f"chat{i}"] = chat(tok, q)
    return out


@pytest.mark.parametrize("pause", [{"speculative_min_accept": 0.0}, {"speculative_pause_steps": 2}],
                         ids=["always-propose", "pausing"])
def test_greedy_equal_with_and_without_speculation(smollm_runner, tok, prompts, pause):
    """Wave 1: every prompt opted out (plain decoding); wave 2: the same prompts speculating (their prompts
    now cached, so the prefill is paid once): always proposing, or pausing after rejected drafts (short pauses,
    so requests pause and propose again within MAX_NEW tokens)."""
    d = Driver(smollm_runner, tok, **SPEC, **pause)
    try:
        for rid, ids in prompts.items():
            d.submit(f"off_{rid}", ids, MAX_NEW, ignore_eos=True, disable_speculation=True)
        d.run()
        assert d.sched.internal_state()["spec_verify_ct"] == 0
        for rid, ids in prompts.items():
            d.submit(rid, ids, MAX_NEW, ignore_eos=True)
        d.run()
        diff = [rid for rid in prompts if d.ids(rid) != d.ids(f"off_{rid}")]
        assert not diff, f"outputs differ with speculation on: {diff}"
        st = d.sched.internal_state()
        assert st["spec_verify_ct"] > 0 and st["spec_accepted_tokens"] > 0 and st["spec_accept_length"] > 1.0
        assert d.final("rag0").spec_verify_ct > 0
        assert (st["spec_pauses"] > 0) == ("speculative_pause_steps" in pause)
    finally:
        d.close()




def test_constrained_and_speculative_outputs_stay_valid(smollm_runner, tok):
    be, schema = person_schema_backend(tok)
    ask = chat(tok, 'Copy this JSON exactly: {"name": "Ada Lovelace", "age": 36} then {"name": "Ada Lovelace", "age": 36}')
    outs: dict[str, dict[str, list[int]]] = {}
    try:
        _run_both(smollm_runner, tok, be, ask, schema, outs)
    finally:
        be.close()
    for rid in ("j0", "j1", "j2"):
        text = tok.decode(outs["on"][rid])
        obj = json.loads(text)
        assert set(obj) == {"name", "age"}, text
    assert outs["on"] == outs["off"]


def _run_both(smollm_runner, tok, be, ask, schema, outs) -> None:
    for mode, cfg in (("off", {}), ("on", SPEC)):
        d = Driver(smollm_runner, tok, grammar_backend=be, **cfg)
        try:
            for i in range(3):
                d.submit(f"j{i}", ask, 40, json_schema=schema)
            d.submit("free", ask, 24, ignore_eos=True)
            d.run()
            outs[mode] = {rid: d.ids(rid) for rid in ("j0", "j1", "j2", "free")}
            if mode == "on":  # the constrained requests speculated too (proposals checked by their grammar)
                assert all(d.final(f"j{i}").spec_verify_ct > 0 for i in range(3))
        finally:
            d.close()


def test_engine_end_to_end_stream_logprobs_and_metrics():
    """Through the three processes: streamed text, the target's logprobs (on vs opted out, float32) and the
    reported speculation figures."""
    import runtime

    eng = runtime.Engine(max_total_tokens=2048, dtype="float32", **SPEC)
    try:
        text = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"
        params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        on = eng.generate(text, params, return_logprob=True)
        off = eng.generate(text, {**params, "disable_speculation": True}, return_logprob=True)
        assert on["output_ids"] == off["output_ids"] and on["text"] == off["text"]
        m = on["meta_info"]
        assert m["spec_verify_ct"] > 0 and m["spec_accept_length"] >= 1.0 and "spec_verify_ct" not in off["meta_info"]
        lp_on = [x[0] for x in m["output_token_logprobs"]]
        lp_off = [x[0] for x in off["meta_info"]["output_token_logprobs"]]
        assert len(lp_on) == 12 and max(abs(a - b) for a, b in zip(lp_on, lp_off, strict=True)) < 1e-3
        chunks = list(eng.generate(text, params, stream=True))
        assert chunks[-1]["text"] == on["text"]
        assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:], strict=False))
        st = eng.get_server_info()["internal_states"][0]
        assert st["spec_verify_ct"] > 0 and 0.0 < st["spec_accept_rate"] <= 1.0
        assert st["kv_free_slots"] + st["kv_evictable_slots"] == 2048
    finally:
        eng.shutdown()
