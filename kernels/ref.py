"""Torch reference implementations: the ground truth every other kernel is tested against.

Simple and obviously correct first; `torch_backend.py` builds the CPU attention path on these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [S, H, D], slots [...] int -> [..., H, D]. index_select on the flattened rows: same values as
    `cache[slots]`, about 10x faster on CPU (row copies instead of the generic advanced-indexing kernel)."""
    flat = cache.reshape(cache.shape[0], -1).index_select(0, slots.reshape(-1).long())
    return flat.view(*slots.shape, *cache.shape[1:])


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_cache, v_cache: [num_slots, Hkv, D] (one layer); loc: [T]; k, v: [T, Hkv, D]."""
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def _up(x: torch.Tensor) -> torch.Tensor:
    """Half precision computes in float32; float32 and float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix_len: int) -> torch.Tensor:
    """One request. q: [E, Hq, D]; k, v: [S, Hkv, D] with S = prefix_len + E. Query i sees keys <= prefix_len + i."""
    e, hq, _ = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    qh = q.transpose(0, 1)  # [Hq, E, D]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    if e == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
    else:
        qpos = torch.arange(e, device=q.device).unsqueeze(1) + prefix_len
        mask = torch.arange(s, device=q.device).unsqueeze(0) <= qpos  # [E, S]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)  # [E, Hq, D]


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
    """Ragged extend: q [T, Hq, D] (requests' new tokens concatenated); the new K/V are already stored.

    Request b's new tokens attend to its prefix_lens[b] cached tokens and causally to each other.
    Returns [T, Hq, D] in q's dtype (computed in float32 when q is half precision, else in q's dtype).
    """
    out = torch.empty_like(q)
    start = 0
    rows = req_pool_indices.tolist()
    for row, plen, elen in zip(rows, prefix_lens, extend_lens, strict=True):
        slots = req_to_token[row, : plen + elen].long()
        qb = q[start : start + elen]
        kb, vb = gather_slots(k_cache, slots), gather_slots(v_cache, slots)
        out[start : start + elen] = _attend(_up(qb), _up(kb), _up(vb), scale, plen).to(q.dtype)
        start += elen
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    """Decode: q [B, Hq, D], one new token per request, already stored; attends to seq_lens[b] slots."""
    out = torch.empty_like(q)
    for b, (row, slen) in enumerate(zip(req_pool_indices.tolist(), seq_lens, strict=True)):
        slots = req_to_token[row, :slen].long()
        kb, vb = _up(gather_slots(k_cache, slots)), _up(gather_slots(v_cache, slots))
        out[b : b + 1] = _attend(_up(q[b : b + 1]), kb, vb, scale, slen - 1).to(q.dtype)
    return out


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused add + RMSNorm: h = x + residual (or x); returns (rmsnorm(h) * weight, h). Computed in float32."""
    h = x if residual is None else x + residual
    hf = _up(h)
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(hf.dtype)).to(x.dtype), h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up for gate_up [T, 2I] (gate first) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation: gelu_tanh(gate) * up for gate_up [T, 2I] (gate first) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def rope_cos_sin(
    head_dim: int, max_pos: int, base: float, scaling: dict | None = None, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """cos/sin table [max_pos, head_dim] (first half cos, second half sin), with Llama-3 style scaling."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        inv_freq = _scale_inv_freq(inv_freq, scaling)
    t = torch.arange(max_pos, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # [max_pos, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * torch.pi / inv_freq
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled)
    if kind in (None, "default"):
        return inv_freq
    raise ValueError(f"unsupported rope scaling {kind!r}")


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding as in HF Llama. q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T]."""
    cs = cos_sin[positions]  # [T, D]
    half = cs.shape[-1] // 2
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = _up(x)
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rot(q), rot(k)
