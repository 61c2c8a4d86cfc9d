"""Cascade decode attention (shared-prefix batches) against the per-request reference."""

from __future__ import annotations

import pytest
import torch

from kernels import ref
from kernels.cascade import cascade_decode_attention, plan_cascade


def _batch(b: int, prefix: int, tails: list[int], hkv: int, g: int, seed: int = 0):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    d, slots_total = 16, 4096
    kc = torch.randn(slots_total, hkv, d, generator=gen)
    vc = torch.randn(slots_total, hkv, d, generator=gen)
    q = torch.randn(b, hkv * g, d, generator=gen)
    perm = torch.randperm(slots_total, generator=gen)
    shared, rest = perm[:prefix], perm[prefix:]
    lens = [prefix + t for t in tails]
    req_to_token = torch.zeros(b, max(lens), dtype=torch.int32)
    for i, t in enumerate(tails):
        own = rest[i * 64 : i * 64 + t]
        req_to_token[i, : prefix + t] = torch.cat([shared, own]).to(torch.int32)
    return q, kc, vc, req_to_token, torch.tensor(lens)


@pytest.mark.parametrize("hkv,g", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("tails", [[1, 5, 9], [3, 3, 3, 3], [1, 40]])
def test_cascade_matches_reference(hkv: int, g: int, tails: list[int]) -> None:
    b = len(tails)
    q, kc, vc, r2t, lens = _batch(b, 300, tails, hkv, g)
    slots = r2t.long()
    plan = plan_cascade(slots, lens, min_prefix=256)
    assert plan is not None and plan.prefix_slots.numel() == 300
    got = cascade_decode_attention(q, kc, vc, plan, 0.25)
    want = ref.decode_attention(q, kc, vc, r2t, torch.arange(b), tuple(lens.tolist()), 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_plan_keeps_one_suffix_token_and_declines_short_or_unshared_prefixes() -> None:
    q, kc, vc, r2t, lens = _batch(2, 300, [0, 4], 1, 1)  # the first request is all prefix
    plan = plan_cascade(r2t.long(), lens, min_prefix=256)
    assert plan is not None and plan.prefix_slots.numel() == 299  # one position left to its suffix
    got = cascade_decode_attention(q, kc, vc, plan, 0.5)
    want = ref.decode_attention(q, kc, vc, r2t, torch.arange(2), tuple(lens.tolist()), 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert plan_cascade(r2t.long(), lens, min_prefix=400) is None  # prefix too short
    _, _, _, r2t, lens = _batch(3, 300, [2, 2, 2], 1, 1)
    r2t[1, 10] = 4095 if r2t[1, 10] != 4095 else 4094  # row 1 diverges at position 10
    assert plan_cascade(r2t.long(), lens, min_prefix=256) is None
    assert plan_cascade(r2t[:1].long(), lens[:1], min_prefix=1) is None  # one request: nothing to share


def test_rows_shorter_than_the_prefix_read_all_their_keys() -> None:
    """A compiled graph's padding rows (seq_len 1) and a short request beside long ones keep the prefix pass."""
    q, kc, vc, r2t, lens = _batch(5, 300, [1, 5, 9, 3, 3], 3, 3)
    r2t[3, :1] = 4000  # padding-like row: one key of its own
    r2t[4, :30] = torch.arange(3000, 3030, dtype=torch.int32)  # a short request with 30 keys, none shared
    lens[3], lens[4] = 1, 30
    plan = plan_cascade(r2t.long(), lens, min_prefix=256)
    assert plan is not None and plan.prefix_slots.numel() == 300
    assert plan.shares.tolist() == [True, True, True, False, False]
    got = cascade_decode_attention(q, kc, vc, plan, 0.25)
    want = ref.decode_attention(q, kc, vc, r2t, torch.arange(5), tuple(lens.tolist()), 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
