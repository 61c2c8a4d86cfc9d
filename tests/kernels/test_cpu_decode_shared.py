"""The native decode op's shared-prefix (cascade) pass against kernels/ref.py, over a grid of prefix lengths.

Calls torch.ops.radixgen.attn_decode directly with an explicit `shared_len`, so prefixes the backend would not
pass (under its SHARED_MIN_PREFIX of 64) run too. B*G = 6 query rows per KV head take the row kernel, 24 and 96
the brgemm path (kernels/cpu/decode_shared.h) where the CPU has it; both must equal the reference.
Grid: shared prefix 0, 1, 31, 128, 200, 1500 (1500 and 200 end in a partial block of 128 keys, 31 and 1 in a
partial block of the row kernel's 32), B 2, 8, 32, own keys 1..100 per request, float32, bfloat16 and a float16 pool
under float32 q (the row kernel at every B), GQA 3,
head_dim 64, pages of 1 in scattered order.
Tolerances: float32 1e-5; bfloat16 2e-2 (bf16 inputs; the brgemm path also rounds softmax probabilities to bf16
before P x V, as the extend path does; the output rounds to bf16 once).
"""

from __future__ import annotations

import pytest
import torch

from kernels import ref
from kernels.cpu import ops
from tests.kernels.cpu_attention_params import DTYPE_GEMMS, Q_DTYPE
from tests.kernels.paged import make_paged_batch, step_meta

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-5}  # f16 pool: the same values both sides
HKV, G, D = 3, 3, 64


@pytest.mark.parametrize(("dtype", "bf16_gemm"), DTYPE_GEMMS, indirect=["bf16_gemm"])
@pytest.mark.parametrize("batch", [2, 8, 32])
@pytest.mark.parametrize("shared", [0, 1, 31, 128, 200, 1500])
def test_decode_shared_prefix_matches_reference(shared, batch, dtype, bf16_gemm) -> None:
    ops.load()
    g = torch.Generator().manual_seed(shared * 41 + batch)
    own = torch.randint(1, 101, (batch,), generator=g).tolist()  # own keys per request, the new token included
    own[0] = 1  # a request whose only own key is its new token
    prefix = [shared + n - 1 for n in own]
    pb = make_paged_batch(prefix, [1] * batch, HKV, D, dtype=dtype, seed=batch + shared)
    rows = pb.req_pool_indices.tolist()
    for r in rows[1:]:  # the first `shared` slots of every request are request 0's (as the radix cache hands them)
        pb.req_to_token[r, :shared] = pb.req_to_token[rows[0], :shared]
    meta = step_meta(pb, prefix, [1] * batch, True)
    qd = Q_DTYPE.get(dtype, dtype)
    q = torch.randn(batch, HKV * G, D, generator=g).to(qd)  # [B, Hq, D]
    k, v = (torch.randn(batch, HKV, D, generator=g).to(qd) for _ in range(2))  # [B, Hkv, D]
    kr, vr = pb.k_cache[0].clone(), pb.v_cache[0].clone()
    ref.store_kv(kr, vr, meta.out_cache_loc, k, v)
    scale = D**-0.5
    want = ref.decode_attention(q, kr, vr, pb.req_to_token, pb.req_pool_indices, meta.seq_lens_cpu, scale)
    got = torch.ops.radixgen.attn_decode(q, k, v, pb.k_cache, pb.v_cache, 0, meta.out_cache_loc, pb.req_to_token,
                                         pb.req_pool_indices, meta.seq_lens, shared, scale)
    assert torch.equal(pb.k_cache[0], kr) and torch.equal(pb.v_cache[0], vr)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
