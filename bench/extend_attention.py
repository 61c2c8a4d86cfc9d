"""Extend (prefill) attention on CPU: kernels/ref.py vs kernels/torch_extend.py, side by side in one process.

One attention layer, SmolLM2-135M shapes (9 q heads, 3 kv heads, head_dim 64), pages of 16 scattered in a pool.
Cases: plain prefills (no prefix) and RAG extends (B requests sharing one cached document prefix, each adding
a question). For RAG the fast path runs twice: with the shared-prefix pass (one gather and one call for all
requests) and without it (each request reads the prefix itself). Median of --runs timings, interleaved.

    python bench/extend_attention.py [--runs 5] [--threads 1] [--out bench/results/extend_attention.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from machine import describe  # noqa: E402  (bench/ is the script directory)

from kernels import ref, torch_extend  # noqa: E402
from tests.kernels.paged import make_paged_batch  # noqa: E402

HQ, HKV, D = 9, 3, 64
CASES = [  # (name, prefix_lens, extend_lens, shared document prefix)
    ("prefill 200", [0], [200], 0),
    ("prefill 2000", [0], [2000], 0),
    ("prefill 4 x 500", [0] * 4, [500] * 4, 0),
    ("RAG 8 x 20-60 over 1000", [1000] * 8, [20 + 5 * i for i in range(8)], 1000),
    ("RAG 32 x 20-60 over 1500", [1500] * 32, [20 + (i * 7) % 41 for i in range(32)], 1500),
]


def build(prefix, extend, shared, dtype):
    pb = make_paged_batch(prefix, extend, HKV, D, page_size=16, dtype=dtype, seed=0)
    rows = pb.req_pool_indices.tolist()
    for r in rows[1:]:
        pb.req_to_token[r, :shared] = pb.req_to_token[rows[0], :shared]
    q = torch.randn(sum(extend), HQ, D).to(dtype)
    return pb, q


def call(fn, pb, q):
    return fn(
        q,
        pb.k_cache[0],
        pb.v_cache[0],
        pb.req_to_token,
        pb.req_pool_indices,
        pb.prefix_lens,
        pb.extend_lens,
        D**-0.5,
    )


def no_share(*args):
    saved = torch_extend.SHARED_MIN_PREFIX
    torch_extend.SHARED_MIN_PREFIX = 1 << 30
    try:
        return torch_extend.extend_attention(*args)
    finally:
        torch_extend.SHARED_MIN_PREFIX = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/extend_attention.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, prefix, extend, shared in CASES:
            pb, q = build(prefix, extend, shared, dtype)
            fns = {"ref": ref.extend_attention, "fast": torch_extend.extend_attention}
            if shared:
                fns["fast, no shared pass"] = no_share
            want = call(ref.extend_attention, pb, q).float()
            err = max((call(f, pb, q).float() - want).abs().max().item() for f in fns.values())
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(a.runs):  # interleaved, so machine noise hits all variants alike
                for k, f in fns.items():
                    t = time.perf_counter()
                    call(f, pb, q)
                    times[k].append((time.perf_counter() - t) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in times.items()}
            ns = med.get("fast, no shared pass")
            rows.append(
                (
                    str(dtype).split(".")[1],
                    name,
                    med["ref"],
                    med["fast"],
                    ns,
                    med["ref"] / med["fast"],
                    max(spread.values()),
                    err,
                )
            )
            print(rows[-1], flush=True)
    lines = [
        "# Extend attention on CPU: ref vs torch_extend",
        "",
        f"`python bench/extend_attention.py --runs {a.runs} --threads {a.threads}` on {describe()} "
        f"({os.cpu_count()} cores, {a.threads} torch thread(s)), torch {torch.__version__}. One layer, "
        f"Hq={HQ}, Hkv={HKV}, D={D}, page size 16. Median ms of {a.runs} interleaved runs; spread = "
        "(max - min) / median of the noisiest variant; max err = largest |fast - ref| over both fast variants.",
        "",
        "| dtype | case | ref ms | fast ms | fast, no shared pass ms | speedup | spread | max err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dt, name, r, f, ns, sp, spr, err in rows:
        nss = f"{ns:.2f}" if ns is not None else "-"
        lines.append(f"| {dt} | {name} | {r:.2f} | {f:.2f} | {nss} | {sp:.1f}x | {spr:.0%} | {err:.1e} |")
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
