"""Cascade decode attention for a batch whose requests share a cached prefix (torch, CPU path).

When the radix cache hands many requests the same prefix (RAG over one document, one long system prompt),
their leading KV slots are literally the same slots. Plain padded decode gathers and reads that prefix once
per request per layer; here it is read once per layer for the whole batch:

    prefix:  all B*G queries of one KV head against the P shared slots, one bmm  -> (o1, lse1)
    suffix:  each request against its own remaining slots, padded + masked       -> (o2, lse2)
    merge:   out = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2,  lse = logaddexp(lse1, lse2)

which is exact softmax attention over the concatenation (up to float rounding). Computed in float32.
Rows shorter than the shared prefix (a compiled graph's padding rows, a short request decoding beside long ones)
take no prefix part (its lse is -inf, its weight 0): their suffix is all their keys.
Shapes: q [B, Hq, D]; kc, vc [S, Hkv, D]; Hq = Hkv * G.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ref import gather_slots
from kernels.shared_prefix import long_rows_prefix_len

CASCADE_MIN_PREFIX = 256  # shorter shared prefixes are not worth a second pass


@dataclass(frozen=True)
class CascadePlan:
    prefix_slots: torch.Tensor  # [P] int64, shared by every request with seq_len > P
    suffix_slots: torch.Tensor  # [B, Ls] int64 (padding positions hold any valid slot)
    suffix_mask: torch.Tensor  # [B, Ls] bool, True where a position is part of the request
    shares: torch.Tensor  # [B] bool, whether the request takes the prefix part (seq_len > P)


def plan_cascade(
    slots: torch.Tensor, seq_lens: torch.Tensor, min_prefix: int = CASCADE_MIN_PREFIX
) -> CascadePlan | None:
    """slots [B, L] (row b valid up to seq_lens[b]); a plan when the rows with >= min_prefix keys before their
    last (at least two) share >= min_prefix leading slots; shorter rows then read all their keys as suffix.

    Invariant: every request keeps at least one suffix position (P <= seq_len - 1 for each sharing row), so
    each suffix softmax has a finite log-sum-exp.
    """
    rows = torch.arange(slots.shape[0], device=slots.device)
    p = long_rows_prefix_len(slots, rows, (seq_lens - 1).tolist(), min_prefix)
    if p == 0:
        return None
    shares = seq_lens > p
    start = torch.where(shares, p, 0)  # [B] first suffix position
    width = int((seq_lens - start).max())
    pos = torch.arange(width, device=slots.device)
    idx = (start.unsqueeze(1) + pos.unsqueeze(0)).clamp_(max=slots.shape[1] - 1)  # [B, width]
    first = int(shares.nonzero()[0])  # a sharing row: its first p slots are the prefix
    return CascadePlan(slots[first, :p], slots.gather(1, idx), pos.unsqueeze(0) < (seq_lens - start).unsqueeze(1),
                       shares)


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
    lse1 = lse1.masked_fill(~plan.shares.view(b, 1, 1, 1), float("-inf"))  # rows without a prefix part
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse) * o1 + torch.exp(lse2 - lse) * o2
    return out.reshape(b, hq, d).to(q.dtype)
