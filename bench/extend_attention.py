"""One question: how much faster is the CPU extend attention (kernels/torch_extend.py) than the reference?

One layer's extend attention at SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64), reference
(`kernels.ref.extend_attention`: bool mask, K/V expanded per head -> SDPA math path) against the fast path
(mask-free flash calls merged by log-sum-exp), side by side in one process, median of --runs, per dtype:
  - rag:     B requests sharing one cached P-token document (same slots), each extending E new tokens
  - chat:    B requests each with its own cached P-token history, extending E tokens
  - prefill: B fresh prompts of L tokens (no cached prefix)
Writes bench/results/extend_attention.md.

    python bench/extend_attention.py [--runs 5] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import ref, torch_extend  # noqa: E402

HQ, HKV, D = 9, 3, 64
SHAPES = {  # name: (batch, cached prefix per request, new tokens per request, prefix shared by all?)
    "rag B=16 P=1200 E=40": (16, 1200, 40, True),
    "rag B=32 P=1500 E=24": (32, 1500, 24, True),
    "chat B=8 P=600 E=30": (8, 600, 30, False),
    "prefill B=4 L=512": (4, 0, 512, False),
    "prefill B=1 L=2000": (1, 0, 2000, False),
}


def make_case(b: int, p: int, e: int, shared: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    n_slots = (p if shared else b * p) + b * e + 1
    k = torch.randn(n_slots, HKV, D, generator=g).to(dtype)
    v = torch.randn(n_slots, HKV, D, generator=g).to(dtype)
    table = torch.zeros(b, p + e, dtype=torch.int32)
    nxt = p if shared else 0
    for r in range(b):
        if p:
            table[r, :p] = torch.arange(p) if shared else torch.arange(nxt, nxt + p)
            nxt += 0 if shared else p
        table[r, p:] = torch.arange(nxt, nxt + e)
        nxt += e
    q = torch.randn(b * e, HQ, D, generator=g).to(dtype)
    return q, k, v, table, torch.arange(b), (p,) * b, (e,) * b


def time_fn(fn, runs: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "extend_attention.md"))
    args = ap.parse_args()
    rows = []
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        for name, (b, p, e, shared) in SHAPES.items():
            q, k, v, table, rows_idx, plens, elens = make_case(b, p, e, shared, dtype)
            a = (q, k, v, table, rows_idx, plens, elens, D**-0.5)
            t_ref = time_fn(lambda a=a: ref.extend_attention(*a), args.runs)
            t_fast = time_fn(lambda a=a: torch_extend.extend_attention(*a), args.runs)
            err = (ref.extend_attention(*a).float() - torch_extend.extend_attention(*a).float()).abs().max()
            rows.append((dt, name, t_ref * 1e3, t_fast * 1e3, t_ref / t_fast, float(err)))
            print(rows[-1], flush=True)
    lines = [
        "# bench/extend_attention.py", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}. One layer, SmolLM2 shapes (Hq {HQ}, Hkv {HKV}, D {D}); median of "
        f"{args.runs} runs, reference and fast path side by side in one process.", "",
        "Command: `python bench/extend_attention.py " + " ".join(sys.argv[1:]) + "`", "",
        "| dtype | shape | reference ms | fast ms | speedup | max abs diff |", "|---|---|---|---|---|---|",
    ]
    lines += [f"| {d} | {n} | {r:.2f} | {f:.2f} | {s:.1f}x | {e:.1e} |" for d, n, r, f, s, e in rows]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
