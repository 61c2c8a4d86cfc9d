"""Tests of runtime.sampling: greedy, filters vs a reference, penalties, bias, min_new_tokens, masks, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.sampling import SamplingInfo, compute_logprobs, process_logits, sample, top_logprobs
from runtime.sampling.params import SamplingParams as SP

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def build(params, outputs=None, steps=None, stop_ids=None, seeds=None, vocab=V):
    B = len(params)
    return SamplingInfo.build(
        params,
        outputs if outputs is not None else [[] for _ in range(B)],
        steps if steps is not None else [0] * B,
        vocab,
        stop_ids if stop_ids is not None else [[] for _ in range(B)],
        default_seed=1234,
        seeds=seeds,
    )


def draws(params: SP, logits: torch.Tensor, n: int, seed: int = 0) -> list[int]:
    """n samples of one request: a batch of n copies, row i at step i (each row is independent)."""
    info = build([params] * n, steps=list(range(n)), seeds=[seed] * n, vocab=logits.numel())
    return sample(logits.expand(n, -1).contiguous(), info).next_ids.tolist()


def reference_probs(logits: torch.Tensor, p: SP) -> list[float]:
    """Plain-Python reference: temperature, top-k, top-p over the renormalised top-k set, min-p."""
    z = [x / p.temperature for x in logits.tolist()]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    probs = [x / sum(e) for x in e]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    k = len(probs) if p.top_k <= 0 else p.top_k
    keep = order[:k]
    mass = sum(probs[i] for i in keep)
    kept, acc = [], 0.0
    for i in keep:
        if acc > p.top_p * mass:
            break
        kept.append(i)
        acc += probs[i]
    top = probs[kept[0]]
    kept = [i for i in kept if probs[i] >= p.min_p * top]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def chi_square(samples: list[int], probs: list[float]) -> float:
    n = len(samples)
    return sum((samples.count(i) - n * q) ** 2 / (n * q) for i, q in enumerate(probs) if q > 0)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = [SP(temperature=0.0), SP(temperature=0.5, top_k=1), SP(temperature=0.0), SP(temperature=1e-7),
              SP(temperature=0.0)]
    info = build(params, vocab=50)
    assert info.is_all_greedy
    assert process_logits(logits, info) is logits  # fast path: nothing to process
    assert sample(logits, info).logprobs is None  # no log_softmax unless asked
    out = sample(logits, info, need_logprobs=True)
    assert out.next_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert torch.equal(out.next_ids, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1).gather(-1, out.next_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, ref)


@pytest.mark.parametrize(
    "p",
    [
        SP(temperature=1.0),
        SP(temperature=0.7, top_k=3),
        SP(temperature=1.3, top_p=0.6),
        SP(temperature=1.0, min_p=0.2),
        SP(temperature=2.0, top_k=5, top_p=0.8, min_p=0.1),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "all"],
)
def test_filters_match_reference(p):
    ref = reference_probs(LOGITS, p)
    got = draws(p, LOGITS, 3000)
    allowed = {i for i, q in enumerate(ref) if q > 0}
    assert set(got) == allowed  # never a filtered-out token, and every kept token shows up
    # df <= 7; P(chi2_7 > 30) ~ 1e-4 (deterministic seeds make this a fixed check)
    assert chi_square(got, ref) < 30.0


def test_frequencies_follow_softmax():
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0, -1.0, 0.5])
    for temperature in (1.0, 0.5):
        p = SP(temperature=temperature)
        got = draws(p, logits, 6000, seed=3)
        assert chi_square(got, reference_probs(logits, p)) < 25.0  # df 5: P(>25) ~ 1e-4


def test_penalties_match_hand_reference():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5]])
    p = SP(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    info = build([p], outputs=[[1, 1, 3]], vocab=5)
    got = process_logits(logits, info)
    # token 1: seen twice, negative -> -1*1.5 - 0.5*2 - 0.3; token 3: seen once, positive -> 0.5/1.5 - 0.5 - 0.3
    expected = torch.tensor([[1.0, -1.5 - 1.0 - 0.3, 2.0, 0.5 / 1.5 - 0.5 - 0.3, -0.5]])
    torch.testing.assert_close(got, expected)
    assert torch.equal(logits, torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5]]))  # input untouched
    # a row without penalties in the same batch is unchanged
    info = build([p, SP(temperature=0.0)], outputs=[[1, 1, 3], [0, 2, 2]], vocab=5)
    got = process_logits(logits.repeat(2, 1), info)
    torch.testing.assert_close(got[1], logits[0])
    # a frequency penalty large enough changes the argmax
    info = build([SP(temperature=0.0, frequency_penalty=2.0)], outputs=[[2]], vocab=5)
    assert sample(logits, info).next_ids.tolist() == [0]


def test_logit_bias():
    logits = LOGITS[None, :].repeat(2, 1)
    info = build([SP(temperature=0.0, logit_bias={"5": 100.0}), SP(temperature=0.0, logit_bias={"0": -100.0})])
    assert sample(logits, info).next_ids.tolist() == [5, 1]
    info = build([SP(temperature=0.0), SP(temperature=0.0)])
    assert info.logit_bias is None


def test_min_new_tokens_blocks_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 0.5]])  # EOS id 2 is the argmax, stop id 3 next
    p = SP(temperature=0.0, min_new_tokens=2)
    info = build([p], outputs=[[4]], stop_ids=[[2, 3]], vocab=5)
    out = sample(logits, info, need_logprobs=True)
    assert out.next_ids.tolist() == [1]
    assert math.isclose(out.logprobs.item(), 0.0 - math.log(math.exp(0) + math.exp(1) + math.exp(0.5)) + 1.0,
                        rel_tol=1e-5)
    info = build([p], outputs=[[4, 4]], stop_ids=[[2, 3]], vocab=5)
    assert sample(logits, info).next_ids.tolist() == [2]
    # sampled rows never draw a blocked id either
    got = [sample(logits, build([SP(min_new_tokens=1)], steps=[s], stop_ids=[[2, 3]], vocab=5)).next_ids.item()
           for s in range(200)]
    assert not {2, 3} & set(got)


def test_allowed_mask_respected():
    torch.manual_seed(1)
    B = 6
    logits = torch.randn(B, V) * 3
    mask = torch.rand(B, V) < 0.4
    mask[torch.arange(B), torch.randint(0, V, (B,))] = True
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=1.5, top_p=0.9),
              SP(temperature=0.8, top_k=2), SP(temperature=1.0, min_p=0.3), SP(temperature=0.0)]
    for step in range(20):
        info = build(params, steps=[step] * B, seeds=list(range(B)))
        out = sample(logits, info, mask, need_logprobs=True)
        assert mask[torch.arange(B), out.next_ids].all()
        masked = logits.masked_fill(~mask, float("-inf"))
        ref = torch.log_softmax(masked, -1).gather(-1, out.next_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(out.logprobs, ref)
        assert out.next_ids[0] == masked[0].argmax() and out.next_ids[5] == masked[5].argmax()


def test_seeded_row_independent_of_batch():
    torch.manual_seed(2)
    target = SP(temperature=0.9, top_p=0.95, sampling_seed=77, frequency_penalty=0.2)
    others = [SP(temperature=0.0), SP(temperature=1.2, top_k=3), SP(temperature=0.5, min_p=0.1, sampling_seed=5),
              SP(temperature=1.0, logit_bias={"1": 3.0})]
    alone, mixed = [], []
    out_ids: list[int] = []
    for step in range(25):
        row = torch.randn(1, 20)
        info = build([target], outputs=[out_ids], steps=[step], vocab=20)
        a = sample(row, info, need_logprobs=True)
        batch_params = others[:2] + [target] + others[2:]
        batch_logits = torch.cat([torch.randn(2, 20), row, torch.randn(2, 20)])
        info = build(batch_params, outputs=[[0], [], out_ids, [3, 3], []], steps=[9, 0, step, 4, 1], vocab=20)
        b = sample(batch_logits, info, need_logprobs=True)
        assert b.next_ids[2] == a.next_ids[0]
        torch.testing.assert_close(b.logprobs[2], a.logprobs[0])
        alone.append(int(a.next_ids[0]))
        mixed.append(int(b.next_ids[2]))
        out_ids = out_ids + [alone[-1]]
    assert len(set(alone)) > 3  # it really sampled


def test_seed_sources_and_distinct_seeds():
    p = SP(temperature=1.0)
    logits = torch.zeros(1, 100)
    # explicit sampling_seed and the `seeds` override give the same stream for the same seed
    s1 = [sample(logits, build([SP(sampling_seed=9)], steps=[i], vocab=100)).next_ids.item() for i in range(30)]
    s2 = [sample(logits, build([p], steps=[i], seeds=[9], vocab=100)).next_ids.item() for i in range(30)]
    s3 = [sample(logits, build([p], steps=[i], seeds=[10], vocab=100)).next_ids.item() for i in range(30)]
    assert s1 == s2
    assert s1 != s3
    # unseeded rows of one batch (e.g. n > 1 siblings) do not all draw the same tokens
    info = build([p] * 8, vocab=100)
    assert len(set(sample(logits.expand(8, -1), info).next_ids.tolist())) > 1
    # different seeds give different distributions over many draws, same seed the same
    a, b = draws(p, LOGITS, 500, seed=1), draws(p, LOGITS, 500, seed=2)
    assert a != b and a == draws(p, LOGITS, 500, seed=1)


def test_build_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        SamplingInfo.build([SP()], [[], []], [0], V, [[]], default_seed=0)
    with pytest.raises(ValueError):
        build([SP()], seeds=[1, 2])


def test_flags_skip_unused_features():
    info = build([SP(temperature=1.0), SP(temperature=0.0, top_k=3, top_p=0.5)])
    assert not (info.need_top_k or info.need_top_p or info.need_min_p)  # filters only on the greedy row
    assert info.counts is None and info.logit_bias is None and info.min_tokens_rows is None
    info = build([SP(temperature=1.0, presence_penalty=0.5)], outputs=[[1]])
    assert info.counts is not None and info.frequency_penalties is None


def test_logprob_helpers():
    torch.manual_seed(3)
    logits = torch.randn(3, 10)
    lp = compute_logprobs(logits)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3))
    values, ids = top_logprobs(lp, 4)
    assert values.shape == (3, 4) and ids.shape == (3, 4)
    ref_v, ref_i = lp.sort(-1, descending=True)
    torch.testing.assert_close(values, ref_v[:, :4])
    assert torch.equal(ids, ref_i[:, :4])
    assert top_logprobs(lp, 50)[0].shape == (3, 10)


def _sorted_reference_keep(probs: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Boolean keep-mask by a full sort: top_k largest, or the smallest prefix whose mass exceeds top_p."""
    vals, order = probs.sort(descending=True)
    keep_sorted = torch.zeros_like(vals, dtype=torch.bool)
    if top_k is not None:
        keep_sorted[:top_k] = True
    else:
        before = torch.cumsum(vals.double(), 0) - vals.double()
        keep_sorted = before <= top_p * probs.double().sum()
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0], ids=["flat", "normal", "peaked"])
def test_thresholds_match_sort_on_large_vocab(scale):
    """top-k above 256 (radix select) and top-p (radix select over mass) against a full sort."""
    from runtime.sampling.sampler import _radix_threshold, _top_k_threshold

    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(3, 5000, generator=g) * scale, dim=-1)
    probs[0, :100] = 0.0  # masked tokens
    for k in (1, 7, 300, 4999):
        th = _top_k_threshold(probs, torch.full((3,), k))
        for r in range(3):
            pos = probs[r] > 0  # zero-probability ties at the boundary may all be kept: harmless
            got, ref = (probs[r] >= th[r]) & pos, _sorted_reference_keep(probs[r], k, None) & pos
            assert torch.equal(got, ref), (k, r)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        th = _radix_threshold(probs, probs, top_p * probs.sum(-1))
        for r in range(3):
            got = probs[r] >= th[r]
            ref = _sorted_reference_keep(probs[r], None, top_p)
            assert torch.equal(got, ref), (top_p, r)


def test_top_k_ties_keep_all_tied():
    from runtime.sampling.sampler import _top_k_threshold

    probs = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1] + [0.0] * 300])
    th = _top_k_threshold(probs, torch.tensor([2]))
    assert (probs[0] >= th[0]).sum() == 2
    from runtime.sampling.sampler import _radix_threshold

    th = _radix_threshold(probs, None, torch.tensor([3.0]))  # 4th largest is tied 0.1: both kept
    assert (probs[0] >= th[0]).tolist()[:5] == [True, True, True, True, True]


@pytest.mark.parametrize("params", [
    [SP(temperature=0.8, top_k=40)] * 3,
    [SP(temperature=1.3, top_k=200, top_p=0.7), SP(temperature=0.6, top_k=5, min_p=0.05), SP(temperature=0.0)],
    [SP(temperature=1.0, top_k=256, top_p=0.9, min_p=0.01)] * 2,
    [SP(temperature=0.9, top_p=0.9), SP(temperature=1.0, top_k=7, top_p=0.5), SP(temperature=0.7, top_p=0.95)],
], ids=["top_k", "mixed_k", "k_max", "top_p"])
def test_top_k_candidates_draw_what_the_full_vocabulary_draws(params, monkeypatch):
    """Rows with top_k <= 256 (or top_p only, whose nucleus lies in the top 256) sample from their candidates
    only (one topk pass over V): the same token as the full-vocabulary path, seed for seed, over a 50k
    vocabulary whose mass sits on ~30 tokens, as a language model's does."""
    from runtime.sampling import sampler

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(params), 50_000, generator=g) * 2
    logits[:, torch.randperm(50_000, generator=g)[:30]] += torch.linspace(9, 15, 30)
    got, want = [], []
    for step in range(25):
        info = build(params, steps=[step] * len(params), vocab=logits.shape[1])
        assert sampler._candidates(logits, info, [0], torch.tensor([0])) is not None
        got.append(sample(logits, info).next_ids.tolist())
        monkeypatch.setattr(sampler, "CANDIDATE_MAX_K", 0)
        want.append(sample(logits, info).next_ids.tolist())
        monkeypatch.setattr(sampler, "CANDIDATE_MAX_K", 256)
    assert got == want
    assert len({ids[0] for ids in got}) > 3  # it really sampled


def test_top_k_candidates_fall_back_on_ties_past_the_cut():
    """A tie group at the k-th value running past the candidates: the full path, which keeps every tied token."""
    from runtime.sampling import sampler

    logits = torch.zeros(1, 1000)
    logits[0, :3] = 5.0
    info = build([SP(temperature=1.0, top_k=2)], vocab=1000)
    assert sampler._candidates(logits, info, [0], torch.tensor([0])) is None
    assert {int(sample(logits, build([SP(temperature=1.0, top_k=2)], steps=[s], vocab=1000)).next_ids[0])
            for s in range(40)} == {0, 1, 2}


def test_top_p_candidates_fall_back_on_a_flat_row():
    """A top-p-only row whose nucleus does not fit in 256 candidates: the full path."""
    from runtime.sampling import sampler

    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(0)) * 0.1
    info = build([SP(temperature=1.0, top_p=0.9)], vocab=5000)
    assert sampler._candidates(logits, info, [0], torch.tensor([0])) is None
