"""The native decode op's shared-prefix (cascade) pass against kernels/ref.py, over a grid of prefix lengths.

Calls torch.ops.radixgen.attn_decode directly with an explicit `shared_len`, so prefixes the backend would not
pass (under its SHARED_MIN_PREFIX of 64) run too. B*G = 6 query rows per KV head take the row kernel, 24 and 96
the brgemm path (kernels/cpu/decode_shared.h) where the CPU has it; both must equal the reference.
Grid: shared prefix 0, 1, 31, 128, 200, 1500 (1500 and 200 end in a partial block of 128 keys, 31 and 1 in a
partial block of the row kernel's 32), B 2, 8, 32, own keys 1..100 per request, float32, bfloat16 and a float16 pool
under float32 q (widened while packing for brgemm in the AVX-512 variant, the row kernel elsewhere), GQA 3,
head_dim 64, pages of 1 in scattered order. Rows shorter than the shared prefix (a compiled graph's padding rows)
read their own keys.
Tolerances: float32 1e-5; bfloat16 2e-2 (bf16 inputs; the brgemm path also rounds softmax probabilities to bf16
before P x V, as the extend path does; the output rounds to bf16 once).
"""

from __future__ import annotations

import pytest
import torch

from kernels import ref
from kernels.cpu import ops
from kernels.cpu.backend import decode_shared_len
from tests.kernels.cpu_attention_params import DTYPE_GEMMS, Q_DTYPE
from tests.kernels.paged import make_paged_batch, step_meta

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-5}  # f16 pool: the same values both sides
HKV, G, D = 3, 3, 64


def _decode_against_reference(prefix: list[int], n_sharing: int, shared: int, dtype: torch.dtype, seed: int,
                              g: torch.Generator) -> None:
    """One decode step of len(prefix) requests (prefix[b] cached keys + the new one) whose first n_sharing rows
    share their first `shared` slots (request 0's, as the radix cache hands them); the op against the reference."""
    batch = len(prefix)
    pb = make_paged_batch(prefix, [1] * batch, HKV, D, dtype=dtype, seed=seed)
    rows = pb.req_pool_indices.tolist()
    for r in rows[1:n_sharing]:
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


@pytest.mark.parametrize(("dtype", "bf16_gemm"), DTYPE_GEMMS, indirect=["bf16_gemm"])
@pytest.mark.parametrize("batch", [2, 8, 32])
@pytest.mark.parametrize("shared", [0, 1, 31, 128, 200, 1500])
def test_decode_shared_prefix_matches_reference(shared, batch, dtype, bf16_gemm) -> None:
    ops.load()
    g = torch.Generator().manual_seed(shared * 41 + batch)
    own = torch.randint(1, 101, (batch,), generator=g).tolist()  # own keys per request, the new token included
    own[0] = 1  # a request whose only own key is its new token
    _decode_against_reference([shared + n - 1 for n in own], batch, shared, dtype, batch + shared, g)


@pytest.mark.parametrize(("dtype", "bf16_gemm"), DTYPE_GEMMS, indirect=["bf16_gemm"])
def test_rows_shorter_than_the_shared_prefix_read_their_own_keys(dtype, bf16_gemm) -> None:
    """A compiled graph pads its batch with rows of seq_len 1; a short request may decode beside long ones. Rows
    with seq_len <= shared_len skip the shared pass and attend all their keys themselves."""
    ops.load()
    shared, n_long = 300, 13
    prefix = [shared + 5 * i for i in range(n_long)] + [0, 0, 40]  # two padding-like rows, one short request
    _decode_against_reference(prefix, n_long, shared, dtype, 7, torch.Generator().manual_seed(11))


def test_backend_leaves_short_rows_out_of_the_shared_prefix() -> None:
    """decode_shared_len: padding rows (seq_len 1) and short requests do not cancel the long rows' prefix."""
    table = torch.arange(4 * 400, dtype=torch.int32).view(4, 400)
    table[1, :300] = table[0, :300]
    table[2, :250] = table[0, :250]
    rows = torch.tensor([0, 1, 2, 3])
    assert decode_shared_len(table, rows, (320, 310, 260, 0)) == 250
    assert decode_shared_len(table, rows, (320, 310, 260, 30)) == 250
    assert decode_shared_len(table, rows[:2], (320, 310)) == 300
    assert decode_shared_len(table, rows, (320, 0, 0, 0)) == 0  # one long row: nothing to share
    assert decode_shared_len(table, rows[[0, 3]], (320, 310)) == 0  # long rows with nothing in common
