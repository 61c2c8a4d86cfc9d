"""Incremental detokenization against the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from runtime.detokenizer.state import Detokenizer
from runtime.messages import FinishLength, FinishStop, ReqTokenOut

TEXTS = [
    "Hello 😀 wörld, 你好! 🎉🎉 naïve café — “quotes” and ¿qué? 👩‍👩‍👧‍👦",
    "def f(x):\n    return x ** 2  # ∑ ∫ ≤ ≥\n\n\tTabs\tand  double  spaces",
    "日本語のテキストと한국어 텍스트와 Ελληνικά και русский текст.",
]


@pytest.fixture(scope="module")
def tok():
    from runtime.models.registry import default_model_path
    from runtime.tokenizer.load import load_tokenizer

    return load_tokenizer(default_model_path())


def _detok(tok, max_states=65536):
    return Detokenizer(lambda ids, skip, spaces: tok.decode(ids, skip, spaces), max_states)


def _stream(detok, rid, ids, chunks, finish=None, **kw):
    """Feed `ids` in pieces of the given sizes, the last piece with `finish`; returns the ReqTextOuts."""
    outs, pos = [], 0
    for k, size in enumerate(chunks):
        piece = ids[pos:pos + size]
        pos += size
        last = k == len(chunks) - 1
        outs.append(detok.process(ReqTokenOut(rid=rid, new_ids=piece, finish_reason=finish if last else None, **kw)))
    return outs


def _apply(outs):
    text = ""
    for o in outs:
        if o.trim:
            text = text[:-o.trim]
        text += o.text_delta
    return text


def test_multibyte_split_across_tokens_never_breaks_utf8(tok):
    ids = tok.encode(TEXTS[0])
    # the emoji really is split across tokens in this vocabulary
    assert any(len(tok.token_bytes(i)) and tok.token_bytes(i)[-1] >= 0x80 and
               tok.token_bytes(i).decode("utf-8", "ignore") != tok.token_bytes(i).decode("utf-8", "replace")
               for i in ids)
    detok = _detok(tok)
    outs = _stream(detok, "r", ids, [1] * len(ids), finish=FinishLength(length=len(ids)))
    for o in outs:
        assert "\ufffd" not in o.text_delta
        assert o.trim == 0
    assert "".join(o.text_delta for o in outs) == tok.decode(ids) == TEXTS[0]
    assert detok.num_states == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_chunking_adds_up_to_full_decode(tok, seed):
    rng = random.Random(seed)
    text = TEXTS[seed % len(TEXTS)]
    ids = tok.encode(text)
    chunks, left = [], len(ids)
    while left:
        c = min(left, rng.randint(1, 4))
        chunks.append(c)
        left -= c
    outs = _stream(_detok(tok), f"r{seed}", ids, chunks, finish=FinishLength(length=len(ids)))
    assert all("\ufffd" not in o.text_delta for o in outs)
    assert "".join(o.text_delta for o in outs) == text


def test_interleaved_rids_keep_separate_state(tok):
    detok = _detok(tok)
    a, b = tok.encode(TEXTS[0]), tok.encode(TEXTS[2])
    got = {"a": "", "b": ""}
    for k in range(max(len(a), len(b))):
        for rid, ids in (("a", a), ("b", b)):
            if k < len(ids):
                fin = FinishLength(length=len(ids)) if k == len(ids) - 1 else None
                got[rid] += detok.process(ReqTokenOut(rid=rid, new_ids=[ids[k]], finish_reason=fin)).text_delta
    assert got == {"a": TEXTS[0], "b": TEXTS[2]}


def test_stop_string_trimmed_even_when_partly_sent(tok):
    text = "The answer is 42.\n\nUser: next"
    ids = tok.encode(text)
    # stop after the token that completes "\n\nUser:"; text before it was partly streamed
    upto = next(k for k in range(1, len(ids) + 1) if "\n\nUser:" in tok.decode(ids[:k]))
    fin = FinishStop(matched="\n\nUser:")
    outs = _stream(_detok(tok), "r", ids[:upto], [1] * upto, finish=fin, stop_trim="\n\nUser:")
    assert _apply(outs) == "The answer is 42."
    assert outs[-1].trim > 0  # "\n\n" had already been sent as deltas


def test_no_stop_trim_keeps_stop_string(tok):
    ids = tok.encode("one two three")
    fin = FinishStop(matched=" three")
    outs = _stream(_detok(tok), "r", ids, [len(ids)], finish=fin, stop_trim=" three", no_stop_trim=True)
    assert _apply(outs) == "one two three"


def test_stop_string_only_cut_where_it_stopped(tok):
    # " x" occurs early (allowed there, e.g. under min_new_tokens) and again at the stopping step
    ids = tok.encode("a x b c x")
    fin = FinishStop(matched=" x")
    outs = _stream(_detok(tok), "r", ids, [len(ids) - 1, 1], finish=fin, stop_trim=" x")
    assert _apply(outs) == "a x b c"


def test_stop_token_id_dropped_from_text_unless_no_stop_trim(tok):
    ids = tok.encode("hi there") + [2]  # 2 = <|im_end|>
    fin = FinishStop(matched=2)
    outs = _stream(_detok(tok), "r", ids, [len(ids)], finish=fin, skip_special_tokens=False)
    assert _apply(outs) == "hi there"
    assert outs[-1].new_ids[-1] == 2  # ids still report it
    outs = _stream(_detok(tok), "r", ids, [len(ids)], finish=fin, skip_special_tokens=False, no_stop_trim=True)
    assert _apply(outs).endswith("<|im_end|>")


def test_special_tokens_skipped_by_default(tok):
    ids = [1] + tok.encode("hello") + [2]
    outs = _stream(_detok(tok), "r", ids, [1] * len(ids), finish=FinishLength(length=len(ids)))
    assert _apply(outs) == "hello"


def test_state_is_bounded_lru(tok):
    detok = _detok(tok, max_states=4)
    for k in range(10):
        detok.process(ReqTokenOut(rid=f"r{k}", new_ids=tok.encode("abc")))
    assert detok.num_states == 4
    detok.drop("r9")
    assert detok.num_states == 3
