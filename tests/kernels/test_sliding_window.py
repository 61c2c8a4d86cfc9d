"""Sliding-window attention in every backend against a dense reference that masks each query's band itself.

Layers 0 and 2 slide (window 7), layer 1 attends globally. Steps over a paged pool: a prefill chunk longer
than the window, a chunk continuing over a prefix (crossing the window edge), a mixed step (decode rows and an
extend row together), then decode-only steps. Every output matches the reference within fp32 1e-4; windowed
decode metadata reads only the last W slots.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kernels import create_attn_backend
from kernels.api import AttnMetadata
from kernels.sliding_window import SlidingWindowBackend, window_decode_meta
from tests.kernels.paged import make_paged_batch, step_meta

WINDOW = 7
WINDOWS = (WINDOW, 0, WINDOW)


def _reference(q: torch.Tensor, pb, meta: AttnMetadata, layer: int, window: int, scale: float) -> torch.Tensor:
    """Per query: softmax over keys (p - window, p] (all keys <= p when window is 0), dense."""
    out, start = torch.empty_like(q), 0
    for row, plen, elen in zip(meta.req_pool_indices.tolist(), meta.prefix_lens_cpu, meta.extend_lens_cpu,
                               strict=True):
        slots = meta.req_to_token[row, : plen + elen].long()
        k = pb.k_cache[layer][slots].transpose(0, 1).float()  # [Hkv, S, D]
        v = pb.v_cache[layer][slots].transpose(0, 1).float()
        qb = q[start : start + elen].transpose(0, 1).float()
        qpos = torch.arange(plen, plen + elen).unsqueeze(1)
        kpos = torch.arange(plen + elen).unsqueeze(0)
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + elen] = o.transpose(0, 1).to(q.dtype)
        start += elen
    return out


def _mixed_meta(pb, decode_prefix: list[int], ext_prefix: int, ext_len: int) -> AttnMetadata:
    """Rows 0..k-1 decode one token after decode_prefix[b]; the last row extends ext_len after ext_prefix."""
    prefix, extend = [*decode_prefix, ext_prefix], [1] * len(decode_prefix) + [ext_len]
    m = step_meta(pb, prefix, extend, False)
    return AttnMetadata(**{**m.__dict__, "num_decode": len(decode_prefix)})


def _backends() -> list[str]:
    names = ["torch", "cpu"]
    if importlib.util.find_spec("triton") is not None:
        names.append("triton")
    return names


@pytest.mark.parametrize("name", _backends())
def test_sliding_window_backend_matches_banded_reference(name: str) -> None:
    if name == "cpu":
        from kernels.cpu import ops

        try:
            ops.load()
        except Exception as e:  # noqa: BLE001 - no toolchain here: nothing native to check
            pytest.skip(f"native cpu kernels unavailable: {e}")
    hq, hkv, d = 4, 2, 16
    final = [30, 26, 20]  # tokens per request at the end
    pb = make_paged_batch([0, 0, 0], final, hkv, d, num_layers=3, seed=3)
    be = create_attn_backend(name, pb.k_cache, pb.v_cache, d**-0.5, WINDOWS)
    assert isinstance(be, SlidingWindowBackend)
    steps = [
        step_meta(pb, [0, 0, 0], [12, 9, 3], False),  # prefill longer than the window
        step_meta(pb, [12, 9, 3], [10, 1, 6], False),  # continuation across the window edge
        _mixed_meta(pb, [22, 10], 9, 3),  # mixed: two decode rows and an extend row
    ]
    steps += [step_meta(pb, [23 + i, 11 + i, 12 + i], [1, 1, 1], True) for i in range(4)]  # decode-only
    g = torch.Generator().manual_seed(0)
    for meta in steps:
        t = sum(meta.extend_lens_cpu)
        be.init_forward(meta)
        for layer, window in enumerate(WINDOWS):
            q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
            got = be.forward(q, k, v, layer)
            want = _reference(q, pb, meta, layer, window, d**-0.5)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_window_decode_meta_reads_only_the_window() -> None:
    pb = make_paged_batch([0, 0], [20, 4], 1, 8, seed=1)
    meta = step_meta(pb, [19, 3], [1, 1], True)
    w = window_decode_meta(meta, 5)
    assert w.seq_lens_cpu == (5, 4) and w.prefix_lens_cpu == (4, 3)
    rows = pb.req_pool_indices.tolist()
    assert torch.equal(w.req_to_token[0], pb.req_to_token[rows[0], 15:20])
    assert torch.equal(w.req_to_token[1, :4], pb.req_to_token[rows[1], :4])
    assert torch.equal(w.out_cache_loc, meta.out_cache_loc)


def test_one_window_size_only() -> None:
    pb = make_paged_batch([0], [4], 1, 8)
    with pytest.raises(ValueError, match="one window size"):
        create_attn_backend("torch", pb.k_cache, pb.v_cache, 0.3, (4, 0, 8))
