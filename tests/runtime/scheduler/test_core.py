"""Req lengths, Batch -> ForwardBatch, and the waiting-queue policies on a hand-built tree."""

from __future__ import annotations

import msgspec
import torch

from radix_cache import RadixCache
from runtime.messages import FinishAbort, FinishLength, FinishStop, ReqTokenOut
from runtime.scheduler.core import Batch, Req, SamplingParams
from runtime.scheduler.policy import order_waiting


def req(rid: str, ids: list[int], arrival: int = 0, **kw) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=5, temperature=0.0), arrival=arrival, **kw)


def test_req_lengths_and_match_cap():
    r = req("a", [1, 2, 3, 4])
    assert r.fill_ids == [1, 2, 3, 4] and r.prompt_len == 4 and r.remaining_new_tokens == 5
    assert r.match_cap() == 3  # one token is always computed
    r.output_ids = [9, 8]
    r.cached_len, r.extend_len = 5, 1
    assert r.fill_ids == [1, 2, 3, 4, 9, 8] and r.seq_len == 6 and r.remaining_new_tokens == 3
    lp = req("b", list(range(10)), return_logprob=True, logprob_start_len=4)
    assert lp.match_cap() == 3  # logits at position 3 score token 4
    lp.prefilled = True
    assert lp.match_cap() == 9  # prompt logprobs already done (e.g. after retraction)
    no_lp = req("c", list(range(10)), logprob_start_len=0)  # return_logprob off: no prompt logprobs
    assert no_lp.match_cap() == 9


def test_finish_reasons_keep_sglangs_json_shape_and_round_trip():
    shapes = {FinishLength(length=3): b'{"type":"length","length":3}',
              FinishLength(length=3, matched=2): b'{"type":"length","length":3,"matched":2}',
              FinishStop(matched="x"): b'{"type":"stop","matched":"x"}',
              FinishStop(): b'{"type":"stop","matched":null}',
              FinishAbort(message="m"): b'{"type":"abort","message":"m"}'}
    codec = msgspec.msgpack.Decoder(ReqTokenOut)
    for fr, js in shapes.items():
        assert msgspec.json.encode(fr) == js and fr.type == msgspec.json.decode(js)["type"]
        out = codec.decode(msgspec.msgpack.encode(ReqTokenOut(rid="r", new_ids=[], finish_reason=fr)))
        assert out.finish_reason == fr and type(out.finish_reason) is type(fr)


def test_batch_forward_batch_view():
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [7, 8])
    a.row, a.cached_len, a.extend_len = 3, 2, 3
    b.row, b.cached_len, b.extend_len = 0, 0, 2
    batch = Batch([a, b], False, torch.tensor([10, 11, 12, 13, 14]), [[0, 2], [1]])
    fb = batch.forward_batch()
    assert fb.input_ids.tolist() == [3, 4, 5, 7, 8]
    assert fb.positions.tolist() == [2, 3, 4, 0, 1]
    assert fb.prefix_lens == (2, 0) and fb.seq_lens == (5, 2) and fb.req_pool_indices.tolist() == [3, 0]
    assert fb.logits_indices.tolist() == [0, 2, 4]
    assert batch.logit_rows == [(0, 2), (2, 1)] and batch.num_tokens == 5


def test_policies_on_a_tree():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4, 5, 6], torch.arange(6))
    tree.insert([9, 9, 9], torch.arange(6, 9))
    w = [
        req("none", [5, 5, 5, 5], arrival=0),
        req("short", [1, 2, 7, 7], arrival=1),
        req("nine_a", [9, 9, 9, 1], arrival=2),
        req("long", [1, 2, 3, 4, 5, 6, 0], arrival=3),
        req("nine_b", [9, 9, 9, 2], arrival=4),
    ]
    assert [r.rid for r in order_waiting("fcfs", w, tree)] == ["none", "short", "nine_a", "long", "nine_b"]
    assert [r.rid for r in order_waiting("lpm", w, tree)] == ["long", "nine_a", "nine_b", "short", "none"]
    # dfs-weight: the [9,9,9] subtree holds two waiting requests, the [1,2,...] one two as well but split;
    # requests of one subtree stay together, heavier (then older) subtrees first.
    dfs = [r.rid for r in order_waiting("dfs-weight", w, tree)]
    assert dfs[0] == "none"  # matched nothing: it sits at the root
    assert {tuple(dfs[1:3]), tuple(dfs[3:5])} == {("nine_a", "nine_b"), ("short", "long")}
    assert [r.rid for r in order_waiting("lpm", w, None)] == [r.rid for r in w]  # no cache: fcfs
    tree.check_integrity()
