"""TritonAttnBackend vs TorchAttnBackend over a multi-step run: prefill chunk, extend over a prefix, decodes.

Two layers, GQA 3, pages of 16 scattered in the pool. Each step both backends get the same q/k/v; outputs
match within fp32 atol = rtol = 1e-4 and the pools stay equal (store_kv is an exact copy).
"""

from __future__ import annotations

import pytest
import torch

from kernels import create_attn_backend
from kernels.api import AttnMetadata
from tests.kernels.paged import make_paged_batch

pytest.importorskip("triton")


def _meta(pb, prefix: list[int], extend: list[int], is_decode: bool) -> AttnMetadata:
    dev = pb.k_cache.device
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    rows = pb.req_pool_indices.tolist()
    loc = torch.cat([pb.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq, strict=True)]).long()

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return AttnMetadata(
        is_decode=is_decode, req_to_token=pb.req_to_token, req_pool_indices=pb.req_pool_indices,
        seq_lens=t(seq), prefix_lens=t(prefix), extend_lens=t(extend), out_cache_loc=loc,
        seq_lens_cpu=tuple(seq), prefix_lens_cpu=tuple(prefix), extend_lens_cpu=tuple(extend),
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_torch_backend(device: str, page_size: int) -> None:
    hq, hkv, d, layers = 6, 2, 16, 2
    chunk1, chunk2, decodes = [5, 1, 20], [4, 30, 1], 3
    final = [a + b + decodes for a, b in zip(chunk1, chunk2, strict=True)]
    pb = make_paged_batch([0] * 3, final, hkv, d, page_size=page_size, num_layers=layers, device=device, seed=11)
    k_t, v_t = pb.k_cache.clone(), pb.v_cache.clone()
    torch_be = create_attn_backend("torch", pb.k_cache, pb.v_cache, d**-0.5)
    triton_be = create_attn_backend("triton", k_t, v_t, d**-0.5)
    assert type(triton_be).__name__ == "TritonAttnBackend"

    steps = [(_meta(pb, [0, 0, 0], chunk1, False), sum(chunk1))]
    steps.append((_meta(pb, chunk1, chunk2, False), sum(chunk2)))
    base = [a + b for a, b in zip(chunk1, chunk2, strict=True)]
    for i in range(decodes):
        steps.append((_meta(pb, [b + i for b in base], [1, 1, 1], True), 3))

    g = torch.Generator().manual_seed(0)
    for meta, t in steps:
        torch_be.init_forward(meta)
        triton_be.init_forward(meta)
        for layer in range(layers):
            q, k, v = (torch.randn(t, h, d, generator=g).to(device) for h in (hq, hkv, hkv))
            call = "decode" if meta.is_decode else "extend"
            want = getattr(torch_be, call)(q, k, v, layer)
            got = getattr(triton_be, call)(q, k, v, layer)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(k_t, pb.k_cache) and torch.equal(v_t, pb.v_cache)
