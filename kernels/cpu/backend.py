"""The native CPU attention backend ("cpu"): one native call per layer for the decode rows and one for the
extend rows of a step, both reading the paged pool in place (kernels/cpu/attention.cpp via kernels/cpu/ops.py).

Data flow: `init_forward(meta)` splits the batch once per step into its decode rows [0, num_decode) and extend
rows [num_decode, B), and finds the decode rows' shared prefix (leading slots every row has in common, from the
radix cache) so that each layer's decode call reads it once for the whole batch. `forward(q, k, v, layer)` then
stores the new K/V and attends, one op call per part.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.api import AttnMetadata
from kernels.cpu import ops

SHARED_MIN_PREFIX = 64  # a shorter common prefix is read per request (a separate pass is not worth it)


class DecodePart(NamedTuple):
    rows: torch.Tensor  # [Bd] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [Bd] int64
    loc: torch.Tensor  # [Bd] int64 slots of the new tokens
    shared_len: int  # leading slots shared by every row (0: none)


class ExtendPart(NamedTuple):
    rows: torch.Tensor  # [Be] int64
    prefix_lens: torch.Tensor  # [Be] int64
    extend_lens: torch.Tensor  # [Be] int64
    loc: torch.Tensor  # [T - Bd] int64
    shared_len: int  # leading cached slots shared by every row (0: none)


def shared_prefix_len(req_to_token: torch.Tensor, rows: torch.Tensor, limits: tuple[int, ...]) -> int:
    """Leading slots common to every row, at most min(limits); 0 when under the minimum.

    Decode passes seq_len - 1 (each row keeps >= 1 key of its own), extend the cached prefix lengths."""
    shortest = min(limits)
    if len(limits) < 2 or shortest < SHARED_MIN_PREFIX:
        return 0
    lead = req_to_token[rows, :shortest]  # [B, shortest]
    same = (lead == lead[:1]).all(0)
    p = int(torch.cumprod(same.to(torch.int32), 0).sum())
    return p if p >= SHARED_MIN_PREFIX else 0


class CpuAttnBackend:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D]. Caches [L, S, Hkv, D], float32 or bfloat16."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        if k_cache.device.type != "cpu":
            raise ValueError("the cpu attention backend needs the KV pool on the CPU")
        ops.load()  # compiles on first use on this machine; raises if the toolchain fails
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.scale = scale
        self.use_shared_prefix = True
        self.meta: AttnMetadata | None = None
        self._dec: DecodePart | None = None
        self._ext: ExtendPart | None = None
        self._nd = 0

    def init_forward(self, meta: AttnMetadata) -> None:
        self.meta = meta
        b = meta.batch_size
        nd = getattr(meta, "num_decode", b if meta.is_decode else 0)
        self._nd = nd
        self._dec = self._ext = None
        if nd:
            rows = meta.req_pool_indices[:nd]
            limits = tuple(n - 1 for n in meta.seq_lens_cpu[:nd])
            p = shared_prefix_len(meta.req_to_token, rows, limits) if self.use_shared_prefix else 0
            self._dec = DecodePart(rows, meta.seq_lens[:nd], meta.out_cache_loc[:nd], p)
        if nd < b:
            rows = meta.req_pool_indices[nd:]
            limits = meta.prefix_lens_cpu[nd:]
            p = shared_prefix_len(meta.req_to_token, rows, limits) if self.use_shared_prefix else 0
            t = sum(meta.extend_lens_cpu[:nd])
            self._ext = ExtendPart(rows, meta.prefix_lens[nd:], meta.extend_lens[nd:], meta.out_cache_loc[t:], p)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        nd, dec, ext = self._nd, self._dec, self._ext
        if ext is None:
            return self._decode(q, k, v, layer_id)
        if dec is None:
            return self._extend(q, k, v, layer_id)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k[:nd], v[:nd], layer_id)
        out[nd:] = self._extend(q[nd:], k[nd:], v[nd:], layer_id)
        return out

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        d, m = self._dec, self.meta
        return torch.ops.radixgen.attn_decode(
            q, k, v, self.k_cache, self.v_cache, layer_id, d.loc, m.req_to_token, d.rows, d.seq_lens,
            d.shared_len, self.scale,
        )

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        e, m = self._ext, self.meta
        return torch.ops.radixgen.attn_extend(
            q, k, v, self.k_cache, self.v_cache, layer_id, e.loc, m.req_to_token, e.rows, e.prefix_lens,
            e.extend_lens, e.shared_len, self.scale,
        )

    # The current model calls these by batch kind; both go through forward (one code path).
    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return self.forward(q, k, v, layer_id)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return self.forward(q, k, v, layer_id)
