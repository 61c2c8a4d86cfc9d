"""Sliding-window attention over any backend: some layers see only the last W positions (Gemma 3: five of six).

Window semantics (as Hugging Face and llama.cpp apply them): a query at position p attends keys at positions
(p - W, p], so at most W keys, itself included.

`SlidingWindowBackend` wraps two instances of one backend over the same pool:
- full-attention layers go to `full` with the step's metadata unchanged;
- sliding-window layers of a decode-only step go to `local`, planned once per step over a windowed metadata
  (`window_decode_meta`): each request's slot row is cut to its last min(seq_len, W) slots, so the backend's
  own decode kernels (native CPU, torch, Triton) read W slots at most and need no window logic of their own;
- sliding-window layers of an extend or mixed step store K/V, then attend through `window_extend_attention`
  (torch, any device): queries in blocks, each block reading only the slots its band (p - W, p] can reach, a
  band mask inside the block. Decode rows of a mixed step are extend rows of length 1 there (exact).
Only the positions (p - W, p] of a sliding-window layer are ever read, so the pool may free or reuse the
sliding-window KV of older positions.

Two pools (`slot_map` given; runtime/executor/swa_memory.py): `full` then runs over a pool of the full-attention
layers only and `local` over a pool of the sliding-window layers only, each indexed by the layer's rank among
its kind. The step's metadata holds full slots; `slot_map` [full_slots + 1] int64 turns them into the sliding
pool's slots (-1: freed). It is applied once per step: to the windowed decode table and to out_cache_loc, and
to each block's key slots in `window_extend_attention`. Without `slot_map` both instances share one pool of
every layer and layer ids pass through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import ref
from kernels.api import AttnMetadata, BaseAttnBackend

EXTEND_BLOCK = 256  # queries per masked attention call in window_extend_attention


def to_local_slots(slot_map: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Full slots (any shape, any int dtype) -> the sliding pool's slots in the same dtype. A freed entry (-1)
    becomes the sliding pool's pad slot (the map's last entry) so a kernel never indexes out of the pool; the
    scheduler's invariant guarantees no query ever attends to one."""
    local = slot_map[full.long()]
    local = torch.where(local >= 0, local, slot_map[-1])
    return local.to(full.dtype)


def window_decode_meta(meta: AttnMetadata, window: int, slot_map: torch.Tensor | None = None) -> AttnMetadata:
    """A decode-only step's metadata with every request cut to its last min(seq_len, window) positions.
    req_to_token becomes a fresh [B, L] table (row b: the slots of positions [seq_len_b - len_b, seq_len_b)),
    req_pool_indices arange(B); out_cache_loc is unchanged (the new token is the last position). With
    `slot_map` the table and out_cache_loc are in the sliding pool's slots."""
    assert meta.is_decode, "windowed metadata is for decode-only steps"
    dev = meta.seq_lens.device
    lens = tuple(min(s, window) for s in meta.seq_lens_cpu)
    longest = max(lens)
    start = meta.seq_lens - torch.tensor(lens, dtype=meta.seq_lens.dtype, device=dev)  # [B]
    cols = (start.unsqueeze(1) + torch.arange(longest, device=dev)).clamp_(max=meta.req_to_token.shape[1] - 1)
    table = meta.req_to_token[meta.req_pool_indices.unsqueeze(1), cols].contiguous()  # [B, L] int32
    seq = torch.tensor(lens, dtype=meta.seq_lens.dtype, device=dev)
    b = meta.batch_size
    loc = meta.out_cache_loc
    if slot_map is not None:
        table, loc = to_local_slots(slot_map, table), to_local_slots(slot_map, loc)
    return AttnMetadata(
        num_decode=b, req_to_token=table, req_pool_indices=torch.arange(b, device=dev),
        seq_lens=seq, prefix_lens=seq - 1, extend_lens=torch.ones_like(seq), out_cache_loc=loc,
        seq_lens_cpu=lens, prefix_lens_cpu=tuple(n - 1 for n in lens), extend_lens_cpu=(1,) * b,
    )


def window_extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, prefix_lens: tuple[int, ...], extend_lens: tuple[int, ...], scale: float,
    window: int, block: int = EXTEND_BLOCK, slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged extend with a window (new K/V already stored): q [T, Hq, D] -> [T, Hq, D] in q's dtype (computed
    in float32 for half precision). Request b's token i (position p_b + i) attends keys (p_b + i - W, p_b + i].
    `slot_map`: req_to_token holds full slots and the caches are the sliding pool (see the module docstring)."""
    out = torch.empty_like(q)
    start = 0
    for row, plen, elen in zip(req_pool_indices.tolist(), prefix_lens, extend_lens, strict=True):
        for qs in range(0, elen, block):
            qe = min(elen, qs + block)
            lo, hi = max(0, plen + qs - window + 1), plen + qe  # keys any query of the block can see
            slots = req_to_token[row, lo:hi].long()
            if slot_map is not None:
                slots = to_local_slots(slot_map, slots)
            kb = ref._up(ref.gather_slots(k_cache, slots)).transpose(0, 1)  # [Hkv, S, D]
            vb = ref._up(ref.gather_slots(v_cache, slots)).transpose(0, 1)
            qb = ref._up(q[start + qs : start + qe]).transpose(0, 1)  # [Hq, E, D]
            qpos = torch.arange(plen + qs, plen + qe, device=q.device).unsqueeze(1)
            kpos = torch.arange(lo, hi, device=q.device).unsqueeze(0)
            mask = (kpos <= qpos) & (kpos > qpos - window)  # [E, S]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                               enable_gqa=qb.shape[0] != kb.shape[0])
            out[start + qs : start + qe] = o.transpose(0, 1).to(q.dtype)
        start += elen
    return out


class SlidingWindowBackend(BaseAttnBackend):
    """Per-layer windows over two instances of one backend (see the module docstring).
    windows[layer]: 0 for full attention, else W (one W for all sliding-window layers). `k_cache`, `v_cache`:
    the pool `local` runs over (the sliding layers' own pool when `slot_map` is given, else the shared one)."""

    def __init__(self, full: BaseAttnBackend, local: BaseAttnBackend, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, scale: float, windows: tuple[int, ...],
                 slot_map: torch.Tensor | None = None) -> None:
        sizes = {w for w in windows if w > 0}
        if len(sizes) != 1:
            raise ValueError(f"sliding-window layers need one window size, got {sorted(sizes)}")
        self.full, self.local = full, local
        self.k_cache, self.v_cache = k_cache, v_cache  # [L or L_sliding, S, Hkv, D]
        self.scale = scale
        self.windows = windows
        self.window = sizes.pop()
        self.slot_map = slot_map
        # layer id -> index into its kind's pool (identity over one shared pool)
        kinds = [bool(w) for w in windows]
        self.index = (tuple(kinds[:i].count(k) for i, k in enumerate(kinds)) if slot_map is not None
                      else tuple(range(len(windows))))

    def init_forward(self, meta: AttnMetadata) -> None:
        self.meta = meta
        self.full.init_forward(meta)
        if meta.is_decode:
            self.local.init_forward(window_decode_meta(meta, self.window, self.slot_map))
        else:
            self.local_loc = (meta.out_cache_loc if self.slot_map is None
                              else to_local_slots(self.slot_map, meta.out_cache_loc))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        i = self.index[layer_id]
        if not self.windows[layer_id]:
            return self.full.forward(q, k, v, i)
        if self.meta.is_decode:
            return self.local.decode(q, k, v, i)
        return self._extend_local(q, k, v, i)

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """A sliding-window layer's extend or mixed step (every row as an extend row)."""
        if not self.windows[layer_id]:
            return self.full.extend(q, k, v, self.index[layer_id])
        return self._extend_local(q, k, v, self.index[layer_id])

    def _extend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_cache[i], self.v_cache[i]
        ref.store_kv(kc, vc, self.local_loc, k, v)
        return window_extend_attention(q, kc, vc, m.req_to_token, m.req_pool_indices, m.prefix_lens_cpu,
                                       m.extend_lens_cpu, self.scale, self.window, slot_map=self.slot_map)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        if not self.windows[layer_id]:
            return self.full.decode(q, k, v, self.index[layer_id])
        return self.local.decode(q, k, v, self.index[layer_id])
