"""The verification rule: given the target model's distributions at the k + 1 positions of a verify row and
the k proposed tokens, which tokens the request emits.

Rows: row i (0 <= i <= k) is the target's next-token distribution after the request's tokens plus drafts
d_1..d_i; it matters only if d_1..d_i were all accepted.

Greedy (`accept_greedy`): emit the target's argmax of row 0, 1, ... while each equals the next draft; the
first mismatch (or row k) is the last emitted token. The emitted tokens are exactly what plain greedy
decoding would produce, so greedy output never changes.

Sampling (`accept_sampled`), the standard rule (Leviathan et al. 2023, Chen et al. 2023): with d_{i+1} drawn
from the proposal distribution q_i, accept it with probability min(1, p_i(d) / q_i(d)); on rejection emit a
sample of the residual max(p_i - q_i, 0) renormalised and stop; when all k are accepted emit a sample of p_k.
Each emitted token is then distributed exactly as under plain sampling from p. A deterministic proposer
(n-gram) has q = one-hot at the draft: accept with p_i(d), the residual is p_i with d removed. The draft
model passes its own q (the proposal must really be drawn from it, or the rule is not exact).

Randomness: the uniforms of row i come from (seed, step of row i) only (`spec_uniforms`), so a request's
draws never depend on its batch neighbours.
"""

from __future__ import annotations

import torch

from runtime.sampling import mix_seed

ACCEPT_SALT = 0x5EC0A
SAMPLE_SALT = 0x5EC0B
DRAFT_SALT = 0x5EC0C


def _unit(x: int) -> float:
    """A 63-bit integer -> a float in [0, 1) (53 random bits)."""
    return min((x >> 10) * 2.0**-53, 1.0 - 2.0**-30)


def spec_uniforms(seed: int, step: int) -> tuple[float, float]:
    """(accept uniform, sample uniform) of the verify row that samples output token number `step`."""
    base = mix_seed(seed, step)
    return _unit(mix_seed(base, ACCEPT_SALT)), _unit(mix_seed(base, SAMPLE_SALT))


def draft_uniform(seed: int, step: int) -> float:
    """The uniform with which a draft model samples its proposal for output token number `step` (independent
    of the verify row's pair)."""
    return _unit(mix_seed(mix_seed(seed, step), DRAFT_SALT))


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """targets: argmax of rows 0..k (len k + 1); drafts: d_1..d_k. Returns the emitted tokens (1..k + 1)."""
    m = 0
    while m < len(drafts) and targets[m] == drafts[m]:
        m += 1
    return targets[: m + 1]


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token of `probs` [V] (unnormalised, non-negative) at cumulative mass u * total, in vocabulary order
    (the sampler's own rule: a zero-probability token is never chosen)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    target = torch.tensor([u], dtype=torch.float64, device=probs.device) * cdf[-1:]
    return int(torch.searchsorted(cdf, target, right=True).clamp_max_(probs.shape[-1] - 1))


def accept_sampled(probs: torch.Tensor, drafts: list[int], uniforms: list[tuple[float, float]],
                   q: torch.Tensor | None = None) -> list[int]:
    """probs: the target's sampling distributions of rows 0..k [k + 1, V], normalised (after temperature and
    the top-k/top-p/min-p cuts); q: the proposal distributions [k, V] normalised, row i the one d_{i+1} was
    drawn from (None: one-hot at the drafts); uniforms[i]: row i's (accept, sample) pair. Returns the emitted
    tokens (1..k + 1)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        u_accept, u_sample = uniforms[i]
        p_d = float(probs[i, d])
        q_d = 1.0 if q is None else float(q[i, d])
        if u_accept * q_d < p_d:  # probability min(1, p_d / q_d)
            out.append(d)
            continue
        if q is None:
            residual = probs[i].clone()
            residual[d] = 0.0
        else:
            residual = (probs[i].double() - q[i].to(probs.device).double()).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # p_i <= q_i everywhere, so p_i == q_i: rejection had probability ~0
            out.append(d)
            continue
        out.append(inverse_cdf(residual, u_sample))
        return out
    out.append(inverse_cdf(probs[len(drafts)], uniforms[len(drafts)][1]))
    return out
