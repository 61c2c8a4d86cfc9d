"""The torch backend's batched decode equals the per-request reference (GQA, ragged lengths, scattered slots)."""

from __future__ import annotations

import pytest
import torch

from kernels import ref
from kernels.api import AttnMetadata
from kernels.torch_backend import TorchAttnBackend


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batched_decode_matches_reference(group, dtype):
    """float16: a float16 pool under float32 q (--kv-cache-dtype float16), both sides reading the same values."""
    g = torch.Generator().manual_seed(group)
    qd = torch.float32 if dtype == torch.float16 else dtype
    hkv, d, slots_total = 2, 16, 256
    lens = [1, 7, 33, 12, 64]
    kc = torch.randn(1, slots_total, hkv, d, generator=g).to(dtype)
    vc = torch.randn(1, slots_total, hkv, d, generator=g).to(dtype)
    table = torch.randint(0, slots_total, (8, 128), generator=g, dtype=torch.int32)  # stale padding slots
    perm = torch.randperm(slots_total, generator=g)
    start = 0
    for row, n in enumerate(lens):
        table[row, :n] = perm[start : start + n].to(torch.int32)
        start += n
    rows = torch.arange(len(lens))
    loc = table[rows, torch.tensor(lens) - 1].long()
    meta = AttnMetadata(len(lens), table, rows, torch.tensor(lens), torch.tensor(lens) - 1, torch.ones(len(lens)),
                        loc, tuple(lens), tuple(n - 1 for n in lens), (1,) * len(lens))
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(qd)
    k_new = torch.randn(len(lens), hkv, d, generator=g).to(qd)
    v_new = torch.randn(len(lens), hkv, d, generator=g).to(qd)
    backend = TorchAttnBackend(kc.clone(), vc.clone(), d**-0.5)
    backend.init_forward(meta)
    got = backend.decode(q, k_new, v_new, 0)
    kr, vr = kc[0].clone(), vc[0].clone()
    ref.store_kv(kr, vr, loc, k_new, v_new)
    want = ref.decode_attention(q, kr, vr, table, rows, tuple(lens), d**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
