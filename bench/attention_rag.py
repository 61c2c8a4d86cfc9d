"""The native attention ops at the `rag` workload's shapes, one layer (SmolLM2-135M: 9 q heads, 3 KV heads,
head_dim 64), pages of 1 in scattered order, 2 threads: float32 q over a float16 pool (the int8 mode's cache on a
CPU without native bf16) and over a float32 pool, and bfloat16 q over a bfloat16 pool (the cache of every mode on
a CPU with AVX512-BF16 or AMX). Median of 7 timed calls after 2 warm-ups; GFLOP/s counts QK^T and PV
(4 * head_dim per query-key pair, causal pairs only).

    PYTHONPATH=$PWD python bench/attention_rag.py

Cases: the document's first chunk (2,048-token prefill); the second step (the first request's last 126 tokens
over its 2,048 cached ones, and 15 questions of 24 tokens over the 2,150-token document, shared prefix 2,048);
a decode step of 16 rows over the 2,150-token document (+3 tokens each).
"""

from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from machine import describe  # noqa: E402

from kernels.cpu import ops  # noqa: E402
from runtime.config import cpu_has_native_bf16  # noqa: E402
from tests.kernels.paged import make_paged_batch  # noqa: E402

HQ, HKV, D = 9, 3, 64
CASES = [  # (name, prefix lens, extend lens, shared prefix, decode)
    ("extend: 2,048-token prefill", [0], [2048], 0, False),
    ("extend: 126 + 15 x 24 over the document", [2048] + [2150] * 15, [126] + [24] * 15, 2048, False),
    ("decode: 16 rows over 2,153 keys", [2153] * 16, [1] * 16, 2150, True),
]


def timed_case(prefix: list[int], extend: list[int], shared: int, decode: bool, dtype: torch.dtype,
               q_dtype: torch.dtype) -> float:
    pb = make_paged_batch(prefix, extend, HKV, D, dtype=dtype, seed=0)
    rows = pb.req_pool_indices.tolist()
    for r in rows[1:]:
        pb.req_to_token[r, :shared] = pb.req_to_token[rows[0], :shared]
    t = sum(extend)
    q, k, v = (torch.randn(t, h, D, dtype=q_dtype) for h in (HQ, HKV, HKV))
    loc = torch.cat([pb.req_to_token[r, p : p + e].long() for r, p, e in zip(rows, prefix, extend, strict=True)])
    pre, ext = torch.tensor(prefix), torch.tensor(extend)
    r2t, idx, scale = pb.req_to_token, pb.req_pool_indices, D**-0.5

    def call() -> torch.Tensor:
        if decode:
            return torch.ops.radixgen.attn_decode(q, k, v, pb.k_cache, pb.v_cache, 0, loc, r2t, idx, pre + ext,
                                                  shared, scale)
        return torch.ops.radixgen.attn_extend(q, k, v, pb.k_cache, pb.v_cache, 0, loc, r2t, idx, pre, ext, shared,
                                              scale)

    for _ in range(2):
        call()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return sorted(times)[3]


def main() -> None:
    torch.set_num_threads(2)
    ops.load()
    print(f"# {describe()}; torch threads {torch.get_num_threads()}; cpu isa {ops.isas()[0]}")
    pairs = [(torch.float32, torch.float16), (torch.float32, torch.float32)]
    if cpu_has_native_bf16():
        pairs.append((torch.bfloat16, torch.bfloat16))
    print("| case | pool (q: float32, or bfloat16 over bfloat16) | ms per layer | GFLOP/s |\n|---|---|---:|---:|")
    for name, prefix, extend, shared, decode in CASES:
        flop = sum(e * (p + (e + 1) / 2) for p, e in zip(prefix, extend, strict=True)) * HQ * D * 4
        for q_dtype, dtype in pairs:
            sec = timed_case(prefix, extend, shared, decode, dtype, q_dtype)
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {sec * 1e3:.2f} | {flop / sec / 1e9:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
