"""Cascade decode attention for a batch whose requests share a cached prefix (torch, CPU path).

When the radix cache hands many requests the same prefix (RAG over one document, one long system prompt),
their leading KV slots are literally the same slots. Plain padded decode gathers and reads that prefix once
per request per layer; here it is read once per layer for the whole batch:

    prefix:  all B*G queries of one KV head against the P shared slots, one bmm  -> (o1, lse1)
    suffix:  each request against its own remaining slots, padded + masked       -> (o2, lse2)
    merge:   out = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2,  lse = logaddexp(lse1, lse2)

which is exact softmax attention over the concatenation (up to float rounding). Computed in float32.
Shapes: q [B, Hq, D]; kc, vc [S, Hkv, D]; Hq = Hkv * G.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ref import gather_slots

CASCADE_MIN_PREFIX = 256  # shorter shared prefixes are not worth a second pass


@dataclass(frozen=True)
class CascadePlan:
    prefix_slots: torch.Tensor  # [P] int64, shared by every request of the batch
    suffix_slots: torch.Tensor  # [B, Ls] int64 (padding positions hold any valid slot)
    suffix_mask: torch.Tensor  # [B, Ls] bool, True where a position is part of the request


def plan_cascade(
    slots: torch.Tensor, seq_lens: torch.Tensor, min_prefix: int = CASCADE_MIN_PREFIX
) -> CascadePlan | None:
    """slots [B, L] (row b valid up to seq_lens[b]); a plan when all rows share >= min_prefix leading slots.

    Invariant: every request keeps at least one suffix position (P <= min(seq_lens) - 1), so each suffix
    softmax has a finite log-sum-exp.
    """
    b = slots.shape[0]
    shortest = int(seq_lens.min())
    if b < 2 or shortest - 1 < min_prefix:
        return None
    same = (slots[:, : shortest - 1] == slots[:1, : shortest - 1]).all(0)  # [shortest - 1]
    p = int(torch.cumprod(same.to(torch.int32), 0).sum())
    if p < min_prefix:
        return None
    width = int(seq_lens.max()) - p
    pos = torch.arange(width, device=slots.device)
    return CascadePlan(slots[0, :p], slots[:, p : p + width], pos.unsqueeze(0) < (seq_lens - p).unsqueeze(1))


def cascade_decode_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: CascadePlan, scale: float
) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = kc.shape[1]
    g = hq // hkv
    f32 = torch.float32
    qf = q.to(f32).view(b, hkv, g, d)
    # Shared prefix: [Hkv, B*G, D] x [Hkv, D, P] in one bmm per step and layer.
    qp = qf.permute(1, 0, 2, 3).reshape(hkv, b * g, d)
    kp = gather_slots(kc, plan.prefix_slots).to(f32).permute(1, 2, 0)  # [Hkv, D, P]
    vp = gather_slots(vc, plan.prefix_slots).to(f32).transpose(0, 1)  # [Hkv, P, D]
    s1 = torch.bmm(qp, kp).mul_(scale)
    lse1 = torch.logsumexp(s1, -1, keepdim=True)  # [Hkv, B*G, 1]
    o1 = torch.bmm(torch.exp(s1 - lse1), vp)  # [Hkv, B*G, D]
    o1 = o1.view(hkv, b, g, d).permute(1, 0, 2, 3)  # [B, Hkv, G, D]
    lse1 = lse1.view(hkv, b, g, 1).permute(1, 0, 2, 3)
    # Per-request suffix, padded to the longest.
    ks = gather_slots(kc, plan.suffix_slots).to(f32).transpose(1, 2)  # [B, Hkv, Ls, D]
    vs = gather_slots(vc, plan.suffix_slots).to(f32).transpose(1, 2)
    s2 = torch.matmul(qf, ks.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, Ls]
    s2.masked_fill_(~plan.suffix_mask[:, None, None, :], float("-inf"))
    lse2 = torch.logsumexp(s2, -1, keepdim=True)
    o2 = torch.matmul(torch.exp(s2 - lse2), vs)  # [B, Hkv, G, D]
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse) * o1 + torch.exp(lse2 - lse) * o2
    return out.reshape(b, hq, d).to(q.dtype)
