"""Fast extend (prefill) attention for the torch backend on CPU: the reference's semantics on the flash kernel.

`kernels.ref.extend_attention` builds a boolean prefix-causal mask and expands K/V per query head, which puts
torch's SDPA on its math fallback (a float32 [Hq, E, S] score block through several elementwise passes).
Here every SDPA call is mask-free, so torch's CPU flash kernel runs it, and GQA needs no copy of K/V:

    A  shared prefix: all T new queries against the P0 leading slots every request shares (RAG: one document,
       many questions), one call per layer; gathered once.                                      -> (oA, lseA)
    B  own prefix:    request b's queries against its remaining cached slots [P0, prefix_b).     -> (oB, lseB)
    C  new tokens:    request b's queries against its own new tokens, causal (square, E x E).    -> (oC, lseC)
    merge:            out = sum_s exp(lse_s - lse) * o_s,  lse = logsumexp_s(lse_s)

which is exact softmax attention over the concatenation (up to float rounding). C always has at least one key
(the query itself), so lse is finite. A request without a cached prefix takes C alone, without LSE or merge.

Layout trick for GQA (Hq = Hkv * G): queries [T, Hkv, G, D] are viewed as batch=Hkv, heads=G, and each KV
head is expanded over G with stride 0 (a view, no copy), so the kernel reads K/V once per KV head.
bf16 stays bf16 (the kernel accumulates in float32); the LSE is float32 and the merge runs in float32.
"""

from __future__ import annotations

import torch

from kernels import ref
from kernels.shared_prefix import common_prefix_len

FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHARED_MIN_PREFIX = 16  # a shared prefix shorter than this is read per request (no extra pass)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """Queries [E, Hq, D] -> [Hkv, G, E, D]."""
    e, hq, d = x.shape
    return x.reshape(e, hq // g, g, d).permute(1, 2, 0, 3)  # a view unless q is oddly strided


def _kv_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """K or V [S, Hkv, D] -> [Hkv, G, S, D], stride 0 over G (a view)."""
    s, hkv, d = x.shape
    return x.permute(1, 0, 2).unsqueeze(1).expand(hkv, g, s, d)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [E, Hq, D], k/v [S, Hkv, D] -> (out [E, Hq, D] in q's dtype, lse [E, Hq] float32). causal needs S == E."""
    g = q.shape[1] // k.shape[1]
    out, lse = _flash(_heads(q, g), _kv_heads(k, g), _kv_heads(v, g), 0.0, causal, scale=scale)
    e, hq, d = q.shape
    # out [Hkv, G, E, D] -> [E, Hq, D]; lse [Hkv, G, E] -> [E, Hq]
    return out.permute(2, 0, 1, 3).reshape(e, hq, d), lse.permute(2, 0, 1).reshape(e, hq)


def shared_prefix_len(req_to_token: torch.Tensor, rows: list[int], prefix_lens: tuple[int, ...]) -> int:
    """Number of leading slots every request's cached prefix has in common (0 for a single request)."""
    return common_prefix_len(req_to_token, rows, prefix_lens, SHARED_MIN_PREFIX)


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in FLASH_DTYPES


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: tuple[int, ...],
    extend_lens: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    """Same contract as `kernels.ref.extend_attention`: q [T, Hq, D] -> [T, Hq, D] in q's dtype.

    Falls back to the reference off CPU or for dtypes the flash kernel does not take.
    """
    if not supported(q, k_cache):
        return ref.extend_attention(
            q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale
        )
    rows = req_pool_indices.tolist()
    out = torch.empty_like(q)
    if not any(prefix_lens):
        start = 0
        for row, elen in zip(rows, extend_lens, strict=True):
            if elen == 0:  # a request with nothing new this step (the flash kernel divides by E)
                continue
            slots = req_to_token[row, :elen]
            k, v = ref.gather_slots(k_cache, slots), ref.gather_slots(v_cache, slots)
            out[start : start + elen] = _attend(q[start : start + elen], k, v, scale, True)[0]
            start += elen
        return out

    t, hq, d = q.shape
    p0 = shared_prefix_len(req_to_token, rows, prefix_lens)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (o [T, Hq, D], lse [T, Hq] float32) per segment
    if p0:
        slots = req_to_token[rows[0], :p0]
        k, v = ref.gather_slots(k_cache, slots), ref.gather_slots(v_cache, slots)
        parts.append(_attend(q, k, v, scale, False))
    own: tuple[torch.Tensor, torch.Tensor] | None = None  # segment B; rows without one keep lse = -inf
    new_lse = torch.empty(t, hq, dtype=torch.float32)
    start = 0
    for row, plen, elen in zip(rows, prefix_lens, extend_lens, strict=True):
        if elen == 0:
            continue
        qb = q[start : start + elen]
        if plen > p0:
            if own is None:
                own = torch.zeros_like(q), torch.full((t, hq), float("-inf"))
            slots = req_to_token[row, p0:plen]
            k, v = ref.gather_slots(k_cache, slots), ref.gather_slots(v_cache, slots)
            own[0][start : start + elen], own[1][start : start + elen] = _attend(qb, k, v, scale, False)
        slots = req_to_token[row, plen : plen + elen]
        k, v = ref.gather_slots(k_cache, slots), ref.gather_slots(v_cache, slots)
        out[start : start + elen], new_lse[start : start + elen] = _attend(qb, k, v, scale, True)
        start += elen
    if own is not None:
        parts.append(own)
    parts.append((out, new_lse))
    return _merge(parts).to(q.dtype)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Partial attentions over disjoint key sets -> attention over their union, in float32 (or float64)."""
    acc = torch.promote_types(parts[0][0].dtype, torch.float32)
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)  # [T, Hq], finite (segment C)
    total = None
    for o, part_lse in parts:
        term = o.to(acc) * torch.exp(part_lse - lse).unsqueeze(-1).to(acc)
        total = term if total is None else total.add_(term)
    assert total is not None  # parts is never empty
    return total
