"""Speculative sampling keeps the target distribution: chi-square tests on a tiny random Llama.

Thousands of requests (temperature 0.8, top-k 40, a frequency penalty: all applied to the target before the
acceptance rule) sample 3 tokens each through the scheduler with speculation on. The proposal is pinned to
the two most likely continuations after the most likely first token, so drafts are accepted often for some
draws and rejected for others (both branches of the rule run). The empirical distributions of (t1, t2) and of
(t2, t3) given the most likely t1 are compared with the exact ones computed from the model's logits.

Draft-model mode: the draft is the target with its weights perturbed; it samples each proposal from its own
processed distribution q (not one-hot) and the rule uses min(1, p/q) and the residual max(p - q, 0). A mutant
that proposes the draft's argmax while the rule uses q fails the (t1, t2) test (chi-square 214 vs 78.8).
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime.config import make_config
from runtime.executor.greedy import OfflineBatch
from runtime.executor.model_runner import create_model_runner
from runtime.messages import TokenizedGenerateReq
from runtime.sampling.params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.speculative import accept_sampled
from tests.runtime.models.tiny import TINY

TEMP, TOP_K, FREQ = 0.8, 40, 0.5
DRAWS = 3000


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked enough that a good draft is often accepted (top p ~0.6)
    path = str(tmp_path_factory.mktemp("tiny_spec"))
    model.save_pretrained(path)
    cfg = make_config(model_path=path, dtype="float32", max_total_tokens=8192, max_running_requests=256,
                      disable_compile=True)
    return create_model_runner(cfg, progress=False)


def _probs(runner, seqs: list[list[int]], outs: list[list[int]]) -> torch.Tensor:
    """The exact sampling distribution [len(seqs), V] after each sequence, its output tokens `outs` penalised."""
    batch = OfflineBatch(runner, seqs)
    try:
        logits = batch.extend(seqs).double()
    finally:
        batch.release()
    for row, out in zip(logits, outs, strict=True):
        for t in out:
            row[t] -= FREQ
    logits = logits / TEMP
    kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
    logits[logits < kth] = -math.inf
    return torch.softmax(logits, dim=-1)


def _chi_square(counts: dict, expected: dict) -> tuple[float, float]:
    """(statistic, critical value at alpha 1e-3): bins with expected < 5 merged into one."""
    big = [b for b, e in expected.items() if e >= 5]
    rest_e = sum(e for b, e in expected.items() if e < 5)
    rest_c = sum(c for b, c in counts.items() if b not in big)
    stat = sum((counts.get(b, 0) - expected[b]) ** 2 / expected[b] for b in big)
    df = len(big) - 1
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
        df += 1
    z = 3.09  # one-sided normal quantile at 1e-3; Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def _setup(runner) -> tuple[list[int], int, list[int]]:
    """The prompt, the most likely first token t1* and the two most likely tokens after it."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, TINY["vocab_size"], (12,), generator=g).tolist()
    t1_star = int(_probs(runner, [prompt], [[]])[0].argmax())
    d1 = int(_probs(runner, [prompt + [t1_star]], [[t1_star]])[0].argmax())
    d2 = int(_probs(runner, [prompt + [t1_star, d1]], [[t1_star, d1]])[0].argmax())
    return prompt, t1_star, [d1, d2]


def _draw(sched, prompt: list[int]) -> list[list[int]]:
    """DRAWS requests of 3 sampled tokens each through `sched`; ends with the strict leak check."""
    sp = SamplingParams(max_new_tokens=3, temperature=TEMP, top_k=TOP_K, frequency_penalty=FREQ, ignore_eos=True)
    draws: dict[str, list[int]] = {}
    for wave in range(0, DRAWS, 250):
        for i in range(wave, min(wave + 250, DRAWS)):
            sched.handle(TokenizedGenerateReq(rid=f"s{i}", input_ids=prompt, sampling_params=sp))
        while sched.has_work():
            for o in sched.step():
                draws.setdefault(o.rid, []).extend(o.new_ids)
    sched.step()
    assert sched.check_memory(strict=True) and sched.flush_cache().success
    st = sched.internal_state()
    # both branches of the rule ran often: accepted drafts, and rejected ones (resampled from the residual)
    assert 200 < st["spec_accepted_tokens"] < st["spec_draft_tokens"] - 200, st
    seqs = list(draws.values())
    assert len(seqs) == DRAWS and all(len(s) == 3 for s in seqs)
    return seqs


def test_speculative_sampling_matches_the_target_distribution(tiny_runner, monkeypatch):
    runner = tiny_runner
    prompt, t1_star, drafts = _setup(runner)
    monkeypatch.setattr("runtime.scheduler.proposer.propose_ngram", lambda tokens, k, lo, hi: drafts[:k])
    cfg = make_config(max_total_tokens=8192, max_running_requests=256, strict_memory_check=True,
                      speculative_algorithm="ngram", speculative_num_draft_tokens=2)
    sched = Scheduler(runner, runner.allocator, runner.req_to_token, cfg, frozenset())
    _check(runner, prompt, t1_star, _draw(sched, prompt))


def test_draft_model_sampling_matches_the_target_distribution(tiny_runner, tmp_path, monkeypatch):
    """The draft (the target with its weights perturbed) samples its proposals from its own processed q (not
    one-hot); the rule min(1, p/q), residual max(p - q, 0) keeps the target distribution."""
    import transformers as tf

    runner = tiny_runner
    prompt, t1_star, _ = _setup(runner)
    torch.manual_seed(5)
    model = tf.LlamaForCausalLM.from_pretrained(runner.model_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    model.save_pretrained(str(tmp_path))
    draft = create_model_runner(make_config(model_path=str(tmp_path), dtype="float32", max_total_tokens=8192,
                                            max_running_requests=256, disable_compile=True), progress=False)
    spread: list[float] = []  # the largest proposal probability of every draft position

    def spy(probs, drafts, uniforms, q=None):
        assert q is not None and q.shape[0] == len(drafts)
        spread.extend(q.max(dim=-1).values.tolist())
        return accept_sampled(probs, drafts, uniforms, q)

    monkeypatch.setattr("runtime.scheduler.speculative.accept_sampled", spy)
    cfg = make_config(max_total_tokens=8192, max_running_requests=256, strict_memory_check=True,
                      speculative_algorithm="draft", speculative_num_draft_tokens=2,
                      speculative_draft_model_path=str(tmp_path))
    sched = Scheduler(runner, runner.allocator, runner.req_to_token, cfg, frozenset(), draft_runner=draft)
    seqs = _draw(sched, prompt)
    assert sum(m < 0.9 for m in spread) > len(spread) // 4  # q is a real distribution, not one-hot
    assert draft.allocator.available() == draft.allocator.num_slots
    _check(runner, prompt, t1_star, seqs)


def _check(runner, prompt: list[int], t1_star: int, seqs: list[list[int]]) -> None:
    """Chi-square of (t1, t2) and of (t2, t3) given t1 = t1* against the exact distributions."""
    p1 = _probs(runner, [prompt], [[]])[0]
    p2_star = _probs(runner, [prompt + [t1_star]], [[t1_star]])[0]
    # (t1, t2): exact p(t1) p(t2 | t1) over the top-k support of t1
    support1 = p1.nonzero().flatten().tolist()
    p2 = _probs(runner, [prompt + [t] for t in support1], [[t] for t in support1])
    expected = {(a, b): DRAWS * float(p1[a]) * float(p2[i, b]) for i, a in enumerate(support1)
                for b in p2[i].nonzero().flatten().tolist()}
    counts: dict = {}
    for s in seqs:
        counts[(s[0], s[1])] = counts.get((s[0], s[1]), 0) + 1
    stat, crit = _chi_square(counts, expected)
    assert stat < crit, f"(t1, t2): chi-square {stat:.1f} >= {crit:.1f}"

    # (t2, t3) given t1 = t1*: exact p(t2 | t1*) p(t3 | t1*, t2)
    given = [s for s in seqs if s[0] == t1_star]
    assert len(given) > DRAWS // 3
    support2 = p2_star.nonzero().flatten().tolist()
    p3 = _probs(runner, [prompt + [t1_star, t] for t in support2], [[t1_star, t] for t in support2])
    expected = {(a, b): len(given) * float(p2_star[a]) * float(p3[i, b]) for i, a in enumerate(support2)
                for b in p3[i].nonzero().flatten().tolist()}
    counts = {}
    for s in given:
        counts[(s[1], s[2])] = counts.get((s[1], s[2]), 0) + 1
    stat, crit = _chi_square(counts, expected)
    assert stat < crit, f"(t2, t3 | t1*): chi-square {stat:.1f} >= {crit:.1f}"
