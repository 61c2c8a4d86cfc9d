"""Per-layer attention on CPU: today's torch backend vs the native "cpu" backend, side by side in one process.

One attention layer at SmolLM2-135M shapes (9 q heads, 3 kv heads, head_dim 64), slots scattered in the pool
(pages of 1). Each timed call is what a layer does per step: store the new K/V, then attend. Cases:
  decode   B requests of context N (own slots each), B in 1/8/32, N in 128/1,600/4,000;
  RAG decode  32 requests, one shared 1,500-token document (same slots, as the radix cache hands it) + 100 own;
  RAG extend  32 requests x 60 new tokens over that 1,500-token shared prefix;
  prefill  1 x 2,000 and 4 x 500 new tokens, no cached prefix.
Rounds alternate torch and cpu; the table gives medians and their ratio. For decode, the KV bytes one call must
read (each distinct slot once: K and V, all KV heads) over the machine's read bandwidth (bench/roofline.py,
bench/results/roofline.json) gives the bound; "bw share" = bound time / measured time of the native op.

    flock /tmp/radixgen-bench.lock python bench/attention_cpu.py [--rounds 15] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kernels.cpu.backend import CpuAttnBackend  # noqa: E402
from kernels.torch_backend import TorchAttnBackend  # noqa: E402
from tests.kernels.paged import make_paged_batch, step_meta  # noqa: E402

HQ, HKV, D = 9, 3, 64
ROOT = Path(__file__).resolve().parent
# (name, prefix_lens, extend_lens, shared leading slots)
CASES = [(f"decode B={b} ctx={n}", [n - 1] * b, [1] * b, 0) for b in (1, 8, 32) for n in (128, 1600, 4000)]
CASES += [
    ("RAG decode 32 x (1500 shared + 100)", [1599] * 32, [1] * 32, 1500),
    ("RAG extend 32 x 60 over 1500 shared", [1500] * 32, [60] * 32, 1500),
    ("prefill 1 x 2000", [0], [2000], 0),
    ("prefill 4 x 500", [0] * 4, [500] * 4, 0),
]


def setup(prefix, extend, shared, dtype):
    pb = make_paged_batch(prefix, extend, HKV, D, page_size=1, dtype=dtype, seed=0)
    rows = pb.req_pool_indices.tolist()
    for r in rows[1:]:
        pb.req_to_token[r, :shared] = pb.req_to_token[rows[0], :shared]
    meta = step_meta(pb, prefix, extend, all(e == 1 for e in extend))
    t = sum(extend)
    qkv = [torch.randn(t, h, D).to(dtype) for h in (HQ, HKV, HKV)]
    return pb, meta, qkv


def kv_bytes(prefix, extend, shared, dtype) -> int:
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    distinct = sum(seq) - shared * (len(seq) - 1)
    return distinct * HKV * D * 2 * torch.finfo(dtype).bits // 8


def share(bound_ms: float, measured_ms: float) -> str:
    """Bandwidth bound over measured time; 'cache' when the op ran faster than DRAM could feed it."""
    s = bound_ms / measured_ms
    return "cache" if s > 1.0 else f"{s:.0%}"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def time_call(backend, meta, qkv, calls: int) -> float:
    backend.init_forward(meta)
    fn = backend.decode if meta.is_decode else backend.extend
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*qkv, 0)
    return (time.perf_counter() - t0) / calls


def run_case(case, dtype, rounds: int) -> dict:
    name, prefix, extend, shared = case
    pb, meta, qkv = setup(prefix, extend, shared, dtype)
    backends = {"torch": TorchAttnBackend(pb.k_cache, pb.v_cache, D**-0.5),
                "cpu": CpuAttnBackend(pb.k_cache, pb.v_cache, D**-0.5)}
    probe = time_call(backends["torch"], meta, qkv, 1)
    calls = max(1, min(50, int(0.05 / max(probe, 1e-6))))
    for b in backends.values():  # warm up
        time_call(b, meta, qkv, calls)
    times = {k: [] for k in backends}
    for _ in range(rounds):
        for k, b in backends.items():
            times[k].append(time_call(b, meta, qkv, calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"case": name, "dtype": str(dtype).removeprefix("torch."), "torch_ms": med["torch"] * 1e3,
            "cpu_ms": med["cpu"] * 1e3, "speedup": med["torch"] / med["cpu"],
            "kv_MB": kv_bytes(prefix, extend, shared, dtype) / 1e6, "decode": meta.is_decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default="", help="run cases whose name contains this")
    ap.add_argument("--out", default=str(ROOT / "results" / "attention_cpu.md"), help="'' to skip writing")
    ap.add_argument("--roofline", default=str(ROOT / "results" / "roofline.json"),
                    help="this machine's bench/roofline.py results (its read bandwidth bounds the decode cases)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = json.loads(Path(args.roofline).read_text())["read_GBps"]
    lines = ["| case | dtype | torch ms | cpu ms | speedup | KV MB read | bw bound ms | bw share |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for dt in args.dtypes.split(","):
        for case in CASES:
            if args.only not in case[0]:
                continue
            r = run_case(case, getattr(torch, dt), args.rounds)
            bound = r["kv_MB"] / 1e3 / bw * 1e3  # ms
            bwcol = f"{bound:.3f} | {share(bound, r['cpu_ms'])}" if r["decode"] else "- | -"
            lines.append(f"| {r['case']} | {r['dtype']} | {r['torch_ms']:.3f} | {r['cpu_ms']:.3f} | "
                         f"{r['speedup']:.2f}x | {r['kv_MB']:.1f} | {bwcol} |")
            print(lines[-1], flush=True)
    head = (f"# Per-layer CPU attention: torch backend vs native cpu backend (`bench/attention_cpu.py`)\n\n"
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {cpu_name()}, "
            f"{args.rounds} interleaved rounds, medians; read bandwidth {bw:.1f} GB/s ({args.roofline}). A share "
            "above 100 % is shown as 'cache': the KV read stays in the CPU's caches across calls, so DRAM "
            "bandwidth does not bound it."
            f"\n`{' '.join(['python bench/attention_cpu.py', *sys.argv[1:]])}`\n\n")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(head + table)


if __name__ == "__main__":
    main()
