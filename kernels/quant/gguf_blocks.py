"""GGUF quantized blocks <-> (codes, block parameters), exactly, in both directions.

A GGUF tensor of shape [N, K] (rows = output features) is stored as N * K / B blocks of B weights, each block
a few bytes of scales followed by packed codes. `unpack` turns the raw block bytes [N, K / B * bytes_per_block]
(uint8, as `gguf.GGUFReader` hands them out) into integer codes [N, K] plus the block parameters; `pack` is its
exact inverse (same bytes back); `dequantize` computes the float32 values exactly as ggml / `gguf.quants` do.
`group_affine` rewrites any of the 4-bit formats as one affine map per group of 32 codes,
value = (q - 8) * scale + zero, which is what the int4 kernels consume.

Formats (ggml `block_*` structs, little endian):
  Q4_0  [d f16][16 B nibbles]            value = d * (q - 8)            q in 0..15
  Q4_1  [d f16][m f16][16 B nibbles]     value = d * q + m
  Q8_0  [d f16][32 x int8]               value = d * q                  q in -128..127
  Q4_K  256 weights: [d f16][dmin f16][12 B: eight 6-bit scales sc, eight 6-bit mins mn][128 B nibbles]
        sub-block j (32 weights): value = (d * sc_j) * q - (dmin * mn_j)
Nibble order: in a 32-weight group, byte i holds weight i (low nibble) and weight i + 16 (high nibble); Q4_K's
64-weight chunk c uses bytes [32c, 32c + 32): low nibbles weights 64c + i, high nibbles 64c + 32 + i.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

GROUP = 32  # weights per scale group in every supported format


class Blocks(NamedTuple):
    """One unpacked GGUF tensor. codes: [N, K] uint8 (int8 for Q8_0). params: float16 / uint8 arrays
    [N, K / 32] (Q4_K's d and dmin: [N, K / 256]), names per format in PARAMS."""

    kind: str  # "Q4_0" | "Q4_1" | "Q8_0" | "Q4_K"
    codes: np.ndarray
    params: dict[str, np.ndarray]


PARAMS = {"Q4_0": ("d",), "Q4_1": ("d", "m"), "Q8_0": ("d",), "Q4_K": ("d", "dmin", "sc", "mn")}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}
KINDS = tuple(PARAMS)


def _split(raw: np.ndarray, kind: str) -> np.ndarray:
    """[N, nbytes] uint8 -> [N, K / B, bytes_per_block]."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return raw.reshape(raw.shape[0], -1, BLOCK_BYTES[kind])


def _nibbles_unpack(qs: np.ndarray) -> np.ndarray:
    """[..., 16 * g] bytes -> [..., 32 * g] codes; bytes [16j, 16j + 16) hold group j (low then high)."""
    q = qs.reshape(*qs.shape[:-1], -1, 16)
    return np.concatenate([q & 0x0F, q >> 4], axis=-1).reshape(*qs.shape[:-1], -1)


def _nibbles_pack(codes: np.ndarray) -> np.ndarray:
    c = codes.reshape(*codes.shape[:-1], -1, 2, 16).astype(np.uint8)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes.shape[:-1], -1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes [..., 12] -> (sc, mn) [..., 8] 6-bit values (ggml get_scale_min_k4)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    a = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    b = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=-1).astype(np.uint8)


def unpack(raw: np.ndarray, kind: str) -> Blocks:
    """Raw GGUF block bytes [N, row_bytes] -> Blocks (codes [N, K])."""
    if kind not in PARAMS:
        raise ValueError(f"GGUF block type {kind} cannot be kept quantized (supported: {', '.join(KINDS)})")
    b = _split(raw, kind)
    n = b.shape[0]
    if kind == "Q8_0":
        codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1)
        return Blocks(kind, codes, {"d": _f16(b[..., 0:2])})
    if kind == "Q4_K":
        sc, mn = _scale_min_k4(b[..., 4:16])
        qs = b[..., 16:].reshape(n, -1, 4, 2, 16)  # chunk c: [2 halves of 16 bytes] -> 64 weights
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)  # [N, blocks, 4, 4, 16]: lo0 lo1 hi0 hi1
        codes = q.reshape(n, -1)
        params = {"d": _f16(b[..., 0:2]), "dmin": _f16(b[..., 2:4]),
                  "sc": sc.reshape(n, -1), "mn": mn.reshape(n, -1)}
        return Blocks(kind, codes, params)
    off = 2 if kind == "Q4_0" else 4
    codes = _nibbles_unpack(b[..., off:]).reshape(n, -1)
    params = {"d": _f16(b[..., 0:2])}
    if kind == "Q4_1":
        params["m"] = _f16(b[..., 2:4])
    return Blocks(kind, codes, params)


def pack(blocks: Blocks) -> np.ndarray:
    """Blocks -> raw GGUF bytes [N, row_bytes] (the exact inverse of `unpack`)."""
    kind, codes, p = blocks
    n = codes.shape[0]
    nb = codes.shape[1] // BLOCK_WEIGHTS[kind]

    def f16_bytes(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(n, nb, 2)

    if kind == "Q8_0":
        parts = [f16_bytes(p["d"]), codes.reshape(n, nb, 32).view(np.uint8)]
    elif kind == "Q4_K":
        c = codes.reshape(n, nb, 4, 4, 16).astype(np.uint8)  # lo0 lo1 hi0 hi1 per 64-weight chunk
        qs = (c[:, :, :, 0:2] | (c[:, :, :, 2:4] << 4)).reshape(n, nb, 128)
        sm = _pack_scale_min_k4(p["sc"].reshape(n, nb, 8), p["mn"].reshape(n, nb, 8))
        parts = [f16_bytes(p["d"]), f16_bytes(p["dmin"]), sm, qs]
    else:
        head = [f16_bytes(p["d"])] + ([f16_bytes(p["m"])] if kind == "Q4_1" else [])
        parts = [*head, _nibbles_pack(codes.reshape(n, nb, 32))]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def dequantize(blocks: Blocks) -> np.ndarray:
    """float32 [N, K], bit-identical to gguf.quants.dequantize (same float32 operations in the same order)."""
    kind, codes, p = blocks
    n = codes.shape[0]
    d = p["d"].astype(np.float32)[..., None]
    if kind == "Q4_K":
        sc = p["sc"].reshape(n, -1, 8).astype(np.float32)
        mn = p["mn"].reshape(n, -1, 8).astype(np.float32)
        dmin = p["dmin"].astype(np.float32)[..., None]
        scale = (d * sc).reshape(n, -1, 1)
        zero = (dmin * mn).reshape(n, -1, 1)
        return (scale * codes.reshape(n, -1, 32).astype(np.float32) - zero).reshape(n, -1)
    q = codes.reshape(n, -1, 32).astype(np.float32)
    if kind == "Q4_0":
        out = d * (q - 8.0)
    elif kind == "Q4_1":
        out = d * q + p["m"].astype(np.float32)[..., None]
    else:
        out = d * q
    return out.reshape(n, -1)


def group_affine(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit Blocks as (codes [N, K] uint8, scale [N, K/32] f32, zero [N, K/32] f32) with
    value = (q - 8) * scale + zero. scale and zero are exact float32 products/sums of the file's f16 fields
    except Q4_1/Q4_K's zero, which carries one float32 rounding (zero = m + 8 d)."""
    kind, codes, p = blocks
    if kind == "Q8_0":
        raise ValueError("Q8_0 is an 8-bit format: use its codes and d directly")
    n = codes.shape[0]
    d = torch.from_numpy(p["d"].astype(np.float32))
    if kind == "Q4_0":
        scale, zero = d, torch.zeros_like(d)
    elif kind == "Q4_1":
        scale, zero = d, torch.from_numpy(p["m"].astype(np.float32)) + 8.0 * d
    else:
        sc = torch.from_numpy(p["sc"].reshape(n, -1, 8).astype(np.float32))
        mn = torch.from_numpy(p["mn"].reshape(n, -1, 8).astype(np.float32))
        dmin = torch.from_numpy(p["dmin"].astype(np.float32))[..., None]
        scale = (d[..., None] * sc).reshape(n, -1)
        zero = 8.0 * scale - (dmin * mn).reshape(n, -1)
    return torch.from_numpy(np.ascontiguousarray(codes)), scale.contiguous(), zero.contiguous()
