"""The native CPU attention backend ("cpu"): one native call per layer for the decode rows and one for the
extend rows of a step, both reading the paged pool in place (kernels/cpu/attention_decode.cpp and
kernels/cpu/attention_extend.cpp via kernels/cpu/ops.py).

Data flow: `init_forward(meta)` splits the batch once per step into its decode rows [0, num_decode) and extend
rows [num_decode, B), and finds the decode rows' shared prefix (leading slots every row has in common, from the
radix cache) so that each layer's decode call reads it once for the whole batch. `forward(q, k, v, layer)` then
stores the new K/V and attends, one op call per part.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.api import AttnMetadata, BaseAttnBackend
from kernels.cpu import ops
from kernels.shared_prefix import common_prefix_len, long_rows_prefix_len

SHARED_MIN_PREFIX = 64  # a shorter common prefix is read per request (a separate pass is not worth it)


class DecodePart(NamedTuple):
    rows: torch.Tensor  # [Bd] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [Bd] int64
    loc: torch.Tensor  # [Bd] int64 slots of the new tokens
    shared_len: int  # leading slots shared by every row longer than it (0: none)


class ExtendPart(NamedTuple):
    rows: torch.Tensor  # [Be] int64
    prefix_lens: torch.Tensor  # [Be] int64
    extend_lens: torch.Tensor  # [Be] int64
    loc: torch.Tensor  # [T - Bd] int64
    shared_len: int  # leading cached slots shared by every row (0: none)


def shared_prefix_len(req_to_token: torch.Tensor, rows: torch.Tensor, limits: tuple[int, ...]) -> int:
    """Leading slots common to every row (kernels/shared_prefix.py), from SHARED_MIN_PREFIX on; extend's."""
    return common_prefix_len(req_to_token, rows, limits, SHARED_MIN_PREFIX)


def decode_shared_len(req_to_token: torch.Tensor, rows: torch.Tensor, limits: tuple[int, ...]) -> int:
    """Decode's shared prefix over the rows with at least SHARED_MIN_PREFIX keys before their new one; the
    others read their own keys (kernels/shared_prefix.py)."""
    return long_rows_prefix_len(req_to_token, rows, limits, SHARED_MIN_PREFIX)


class CpuAttnBackend(BaseAttnBackend):
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D]. Caches [L, S, Hkv, D]: float32 or bfloat16 as q, or
    float16 under float32 q."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        if k_cache.device.type != "cpu":
            raise ValueError("the cpu attention backend needs the KV pool on the CPU")
        ops.load()  # compiles on first use on this machine; raises if the toolchain fails
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.scale = scale
        self.use_shared_prefix = True
        self._dec: DecodePart | None = None
        self._ext: ExtendPart | None = None

    def init_forward(self, meta: AttnMetadata) -> None:
        self.meta = meta
        nd = meta.num_decode
        self._dec = self._plan_decode(meta) if nd else None
        self._ext = self._plan_extend(meta, nd) if nd < meta.batch_size else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Decode rows through one decode call, extend rows through one extend call."""
        dec, ext = self._dec, self._ext
        if ext is None:
            assert dec is not None  # init_forward plans at least one part for a non-empty step
            return self._decode(dec, q, k, v, layer_id)
        if dec is None:
            return self._extend(ext, q, k, v, layer_id)
        nd = self.meta.num_decode
        out = torch.empty_like(q)
        out[:nd] = self._decode(dec, q[:nd], k[:nd], v[:nd], layer_id)
        out[nd:] = self._extend(ext, q[nd:], k[nd:], v[nd:], layer_id)
        return out

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        if not self.meta.is_decode:
            raise ValueError("decode() needs a step whose rows are all decode rows")
        assert self._dec is not None  # init_forward planned it
        return self._decode(self._dec, q, k, v, layer_id)

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        ext = self._ext if self.meta.is_extend else self._plan_extend(self.meta, 0)
        assert ext is not None  # init_forward planned it for an all-extend step
        return self._extend(ext, q, k, v, layer_id)

    def _plan_decode(self, m: AttnMetadata) -> DecodePart:
        nd = m.num_decode
        rows = m.req_pool_indices[:nd]
        limits = tuple(n - 1 for n in m.seq_lens_cpu[:nd])  # each row keeps >= 1 key of its own
        p = decode_shared_len(m.req_to_token, rows, limits) if self.use_shared_prefix else 0
        return DecodePart(rows, m.seq_lens[:nd], m.out_cache_loc[:nd], p)

    def _plan_extend(self, m: AttnMetadata, first: int) -> ExtendPart:
        """Rows [first, B) as extend rows; their tokens follow the `first` decode tokens."""
        rows = m.req_pool_indices[first:]
        p = shared_prefix_len(m.req_to_token, rows, m.prefix_lens_cpu[first:]) if self.use_shared_prefix else 0
        return ExtendPart(rows, m.prefix_lens[first:], m.extend_lens[first:], m.out_cache_loc[first:], p)

    def _decode(self, d: DecodePart, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.ops.radixgen.attn_decode(
            q, k, v, self.k_cache, self.v_cache, layer, d.loc, self.meta.req_to_token, d.rows, d.seq_lens,
            d.shared_len, self.scale,
        )

    def _extend(self, e: ExtendPart, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.ops.radixgen.attn_extend(
            q, k, v, self.k_cache, self.v_cache, layer, e.loc, self.meta.req_to_token, e.rows, e.prefix_lens,
            e.extend_lens, e.shared_len, self.scale,
        )
