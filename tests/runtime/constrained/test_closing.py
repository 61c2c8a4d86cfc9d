"""The closing window's token classes, string scan and restriction of masked logits
(runtime/constrained/closing.py); through the scheduler on the real model: tests/runtime/constrained/test_model.py."""

from __future__ import annotations

import json

import torch

from runtime.constrained.closing import Closers, in_string, window

VOCAB = [b"a", b'"', b"}", b'"}', b'",', b'""', b"]", b"", b"}]", b"<|im_end|>", b" }", b'"]}', b'}"']
NEG = float("-inf")


def closers() -> Closers:
    return Closers(len(VOCAB), lambda i: VOCAB[i])


def allowed(row: torch.Tensor) -> list[bytes]:
    return [VOCAB[i] for i in (row > NEG).nonzero().flatten().tolist()]


def test_token_classes() -> None:
    c = closers()
    pick = lambda m: [VOCAB[i] for i in range(len(VOCAB)) if m[i]]  # noqa: E731
    assert pick(c.ends) == [b"}", b"]", b"}]"]
    assert pick(c.quotes) == [b'"', b'""']
    assert pick(c.quote_ends) == [b'"}', b'"]}']


def test_in_string() -> None:
    assert not in_string(b"") and not in_string(b'{"a":"b"') and not in_string(b'{"a":1')
    assert in_string(b'{"a":"b') and in_string(b'{"a') and in_string(b'{"a":"x\\"y') and in_string(b'{"a":"x\\\\\\"')
    assert not in_string(b'{"a":"x\\\\"') and in_string(b'{"a":"}]')


def test_in_string_on_every_prefix_of_json_documents() -> None:
    """Against a byte-by-byte scanner over every prefix of documents with escapes in keys and values."""

    def scan(text: bytes) -> bool:
        inside = escaped = False
        for b in text:
            if escaped:
                escaped = False
            elif inside and b == 0x5C:
                escaped = True
            elif b == 0x22:
                inside = not inside
        return inside

    docs = [{"a\\\"b": ["x\\", "\"q\"", "\\\\\"", 1.5, None, {"\u00e9": "tab\there"}]}, ["", "\"", "\\"], "é\n"]
    for doc in docs:
        for ascii_only in (True, False):
            text = json.dumps(doc, ensure_ascii=ascii_only).encode()
            assert all(in_string(text[:i]) == scan(text[:i]) for i in range(len(text) + 1)), text


def test_restrict_by_class_in_order() -> None:
    logits = torch.zeros(5, len(VOCAB))
    logits[2, [2, 6, 8]] = NEG  # outside a string, no end allowed: quotes
    logits[3] = NEG
    logits[3, [0, 4]] = 0.0  # no closer allowed: untouched
    logits[4, [3, 11]] = NEG  # inside, no quote_end allowed: quotes
    before = logits.clone()
    changed = closers().restrict(logits, [0, 1, 2, 3, 4], [False, True, False, False, True])
    assert changed == [True, True, True, False, True]
    assert allowed(logits[0]) == [b"}", b"]", b"}]"]  # outside: ends, not "}" or "}]" content
    assert allowed(logits[1]) == [b'"}', b'"]}']  # inside: a quote that also closes, before a bare quote
    assert allowed(logits[2]) == [b'"', b'""']
    assert torch.equal(logits[3], before[3])
    assert allowed(logits[4]) == [b'"', b'""']


def test_restrict_touches_only_its_rows_and_reports_no_change_when_only_closers_were_allowed() -> None:
    logits = torch.randn(3, len(VOCAB))
    before = logits.clone()
    closers().restrict(logits, [1], [False])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert allowed(logits[1]) == [b"}", b"]", b"}]"]
    logits = torch.full((1, len(VOCAB)), NEG)
    logits[0, 2] = 0.0
    assert closers().restrict(logits, [0], [False]) == [False]


def test_window() -> None:
    assert window(1024, 128) == 128 and window(48, 128) == 12 and window(3, 128) == 0 and window(1024, 0) == 0
