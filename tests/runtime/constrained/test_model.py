"""Constrained decoding through the scheduler on the real SmolLM2 model (CPU): the 30 schemas and 20 regexes
sampled at temperature 0.7 (batched), a constrained/unconstrained mixed batch, jump-forward on vs off, and a
grammar error aborting only its request."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from runtime.config import GrammarConfig, make_config
from runtime.constrained import GrammarBackend
from runtime.messages import TokenizedGenerateReq
from runtime.sampling.params import SamplingParams
from runtime.scheduler import Scheduler
from tests.runtime.constrained.cases import LONG_KEYS, REGEXES, SCHEMAS


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


@pytest.fixture(scope="module")
def backend(tok):
    be = GrammarBackend.from_tokenizer(tok, GrammarConfig(grammar_compile_timeout=60.0), num_workers=2)
    yield be
    be.close()


def run(runner, tok, backend, reqs: dict[str, tuple[str, SamplingParams]], **cfg) -> tuple[dict, Scheduler]:
    """Submit every (prompt, params) at once, step until idle; rid -> (output ids, finish_reason)."""
    alloc = runner.allocator
    config = make_config(
        max_total_tokens=alloc.num_slots,
        max_running_requests=runner.req_to_token.size,
        **{"grammar_compile_timeout": 60.0, **cfg},
    )
    sched = Scheduler(
        runner,
        alloc,
        runner.req_to_token,
        config,
        runner.eos_token_ids,
        tok.decode,
        grammar_backend=backend,
        encode_fn=lambda s: tok.encode(s, add_special_tokens=False, allow_special=False),
        token_bytes_fn=tok.token_bytes,
    )
    for rid, (prompt, sp) in reqs.items():
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        sched.handle(TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=sp))
    outs: dict[str, list[int]] = {rid: [] for rid in reqs}
    fin: dict[str, dict] = {}
    deadline = time.monotonic() + 600
    while sched.has_work() and time.monotonic() < deadline:
        if sched.grammar_queue and not (sched.waiting or sched.running):
            time.sleep(0.01)  # compiles run in worker processes; do not spin
        for o in sched.step():
            outs[o.rid].extend(o.new_ids)
            if o.finish_reason is not None:
                fin[o.rid] = o.finish_reason
    assert not sched.has_work()
    assert sched.flush_cache().success
    return {rid: (outs[rid], fin.get(rid)) for rid in reqs}, sched


def text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t not in tok.eos_token_ids])


ASK = "Answer with a value matching this constraint: {}"  # the model sees the constraint (it stops sooner)


def test_thirty_schemas_on_the_model_validate(smollm_runner, tok, backend) -> None:
    reqs = {
        f"s{i}": (
            ASK.format(json.dumps(s)[:300]),
            SamplingParams(max_new_tokens=160, temperature=0.7, sampling_seed=i, json_schema=json.dumps(s)),
        )
        for i, s in enumerate(SCHEMAS)
    }
    res, sched = run(smollm_runner, tok, backend, reqs)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for i, schema in enumerate(SCHEMAS):
        ids, fin = res[f"s{i}"]
        # "length": the closing window ended it (runtime/constrained/closing.py), still a valid document
        assert fin.type in ("stop", "length"), (i, fin, text(tok, ids))
        jsonschema.validate(json.loads(text(tok, ids)), schema, format_checker=checker)
    assert sched.stats["jump_forward_tokens"] > 0


def test_twenty_regexes_on_the_model_fullmatch(smollm_runner, tok, backend) -> None:
    reqs = {
        f"r{i}": (
            ASK.format(rx),
            SamplingParams(max_new_tokens=64, temperature=0.7, sampling_seed=i, regex=rx),
        )
        for i, (rx, _) in enumerate(REGEXES)
    }
    res, _ = run(smollm_runner, tok, backend, reqs)
    for i, (rx, mod) in enumerate(REGEXES):
        ids, fin = res[f"r{i}"]
        assert fin.type == "stop", (rx, fin, text(tok, ids))
        assert mod.fullmatch(rx, text(tok, ids)), (rx, text(tok, ids))


PLAIN = {"u0": "Name a fruit.", "u1": "What is 2+2?", "u2": "Say hello to Bob."}


def test_mixed_batch_unconstrained_outputs_unchanged(smollm_runner, tok, backend) -> None:
    plain = {
        rid: (p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        for rid, p in PLAIN.items()
    }
    alone, _ = run(smollm_runner, tok, backend, plain)
    cons = {
        f"c{i}": (
            "Reply in JSON.",
            SamplingParams(max_new_tokens=40, temperature=0.0, json_schema=json.dumps(SCHEMAS[i])),
        )
        for i in range(3)
    }
    cons["c_rx"] = ("A date.", SamplingParams(max_new_tokens=20, temperature=0.0, regex=REGEXES[2][0]))
    mixed, _ = run(smollm_runner, tok, backend, {**plain, **cons})
    for rid in PLAIN:
        assert mixed[rid][0] == alone[rid][0], rid


def test_jump_forward_on_off_valid_and_fewer_steps(smollm_runner, tok, backend) -> None:
    sp = SamplingParams(max_new_tokens=80, temperature=0.0, json_schema=json.dumps(LONG_KEYS))
    on, s_on = run(smollm_runner, tok, backend, {"a": ("Describe a customer in JSON.", sp)})
    off, s_off = run(
        smollm_runner, tok, backend, {"a": ("Describe a customer in JSON.", sp)}, disable_jump_forward=True
    )
    for res in (on, off):
        ids, fin = res["a"]
        assert fin.type == "stop", (fin, text(tok, ids))
        jsonschema.validate(json.loads(text(tok, ids)), LONG_KEYS)
    assert s_off.stats["jump_forward_steps"] == 0
    assert s_on.stats["jump_forward_tokens"] > 0
    assert s_on.stats["forward_steps"] * 1.5 <= s_off.stats["forward_steps"], (s_on.stats, s_off.stats)
    # No greedy equality here: forced text is appended as whole tokens (re-tokenized with the token sampled
    # in that step), so the model sees different ids than when it decodes the same text token by token.


def test_grammar_error_aborts_only_that_request(smollm_runner, tok, backend, monkeypatch) -> None:
    from runtime.constrained.grammar import MatcherGrammar

    real = MatcherGrammar.accept_token

    def broken(self, tid):  # the 3rd accepted token of any grammar raises
        if self.num_accepted >= 2:
            raise RuntimeError("simulated matcher failure")
        return real(self, tid)

    monkeypatch.setattr(MatcherGrammar, "accept_token", broken)
    reqs = {
        "bad": ("A date.", SamplingParams(max_new_tokens=20, temperature=0.0, regex=REGEXES[2][0])),
        "ok": ("Name a fruit.", SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)),
    }
    res, _ = run(smollm_runner, tok, backend, reqs, disable_jump_forward=True)
    assert res["bad"][1].type == "abort" and "simulated matcher failure" in res["bad"][1].message
    assert res["ok"][1].type == "length" and len(res["ok"][0]) == 8


def test_runaway_compile_aborts_while_others_stream(smollm_runner, tok) -> None:
    slow = r'"([^"\\]|\\["\\/bfnrt]){0,40}"'  # passes validation; the index build is exponential in the bound
    outlines = GrammarConfig(grammar_backend="outlines", grammar_compile_timeout=2.0)  # the killable compile
    with GrammarBackend.from_tokenizer(tok, outlines, num_workers=1) as be:
        reqs = {
            "slow": ("A string.", SamplingParams(max_new_tokens=8, temperature=0.0, regex=slow)),
            "ok": ("Name a fruit.", SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)),
        }
        t0 = time.monotonic()
        res, _ = run(smollm_runner, tok, be, reqs, grammar_compile_timeout=2.0)
        elapsed = time.monotonic() - t0
    assert res["slow"][1].type == "abort" and "timed out" in res["slow"][1].message, res["slow"]
    assert res["ok"][1].type == "length" and len(res["ok"][0]) == 6
    assert elapsed < 30


STORY = {"type": "object", "properties": {"story": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}}, "required": ["story", "tags"]}


def test_json_answer_closes_within_its_budget(smollm_runner, tok, backend) -> None:
    """A model pushed to run on inside a string (logit bias on "a") ends its JSON validly in the closing window
    (runtime/constrained/closing.py), finish_reason `length`; with the window off it is cut mid-string. Other
    rows of the batch (a regex request in its last tokens, an unconstrained one) are not touched."""
    a = tok.encode("a", add_special_tokens=False, allow_special=False)
    assert len(a) == 1
    sp = SamplingParams(max_new_tokens=48, temperature=0.0, json_schema=json.dumps(STORY),
                        logit_bias={str(a[0]): 30.0})
    reqs = {"json": ("Tell a long story in JSON.", sp),
            "rx": ("Letters.", SamplingParams(max_new_tokens=12, temperature=0.0, regex="[a-z]{1,40}",
                                              logit_bias={str(a[0]): 30.0})),
            "plain": ("Name a fruit.", SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))}
    on, _ = run(smollm_runner, tok, backend, reqs)
    off, _ = run(smollm_runner, tok, backend, reqs, json_close_reserve=0)
    ids, fin = on["json"]
    doc = json.loads(text(tok, ids))
    jsonschema.validate(doc, STORY)
    assert fin.type == "length" and len(ids) <= 48 and doc["story"].startswith("aaaa"), (fin, doc)
    ids, fin = off["json"]
    assert fin.type == "length" and len(ids) == 48
    with pytest.raises(ValueError):
        json.loads(text(tok, ids))
    assert on["rx"] == off["rx"] and on["plain"] == off["plain"]
    # the window is the last min(reserve, max_tokens / 4) tokens: an answer ending before it is untouched
    short = {"json": ("Tell a long story in JSON.", SamplingParams(max_new_tokens=400, temperature=0.0,
                                                                   json_schema=json.dumps(STORY)))}
    a1, _ = run(smollm_runner, tok, backend, short)
    a0, _ = run(smollm_runner, tok, backend, short, json_close_reserve=0)
    if len(a0["json"][0]) < 300:
        assert a1 == a0
