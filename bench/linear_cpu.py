"""One question: per batch size, how fast are SmolLM2's float32 linears on this CPU through each kernel radixgen
could use: MKL on its packed weights (what inductor's freezing emits for a float32 linear), torch's plain
F.linear, the panel kernel of kernels/cpu/linear.cpp, and the weight-only int4/int8 kernels (bf16 activations)?

Per row count M: microseconds per call of each of one layer's four linears and the lm_head, and their sum over a
whole step (30 layers + lm_head) in ms. Every timing is --calls back-to-back calls; rounds alternate the kernels;
medians over rounds. The weights are hot in cache for the smaller shapes (a real step streams ~540 MB of
float32 weights), so the step sums are a lower bound; the in-process and served runs measure the step.

    flock /tmp/radixgen-bench.lock .venv/bin/python bench/linear_cpu.py [--rounds 5] [--rows 1,2,4,8,16,32,64,256]

--isa forces the ISA variant of the panel kernel (kernels/cpu/isa.h; default: the start-up choice).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine import describe  # noqa: E402  (bench/ is the script directory)

from bench.roofline import cpu_model  # noqa: E402
from kernels.cpu import build, ops  # noqa: E402
from kernels.quant import quantize, to_kernel  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def kernels_for(m: int, w: torch.Tensor, name: str) -> dict:
    x = torch.randn(m, w.shape[1])
    mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    panels = ops.pack_panels(w)
    q = to_kernel(quantize(w, "int8" if name == "lm_head" else "int4", 32), "cpu")
    xb = x.to(torch.bfloat16)
    return {
        "mkl packed": lambda: torch.ops.mkl._mkl_linear(x, mkl_w, w, None, m),
        "F.linear": lambda: torch.nn.functional.linear(x, w),
        "panels": lambda: ops.linear_panels(x, panels),
        "int4/int8 (bf16 act)": lambda: q(xb),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--out", default="")
    ap.add_argument("--isa", default="auto", help="ISA variant of the panel kernel (avx512, avx2, portable)")
    args = ap.parse_args()
    isa = ops.cpu_isa(args.isa)
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g) / s[1] ** 0.5 for n, s in SHAPES.items()}
    rows = [int(r) for r in args.rows.split(",")]
    table: dict[tuple[int, str, str], float] = {}
    for m in rows:
        fns = {n: kernels_for(m, w, n) for n, w in weights.items()}
        for fn_by_kernel in fns.values():
            for f in fn_by_kernel.values():
                f()  # warm-up
        samples: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for n, by_kernel in fns.items():
                items = list(by_kernel.items())
                for k, f in items if r % 2 == 0 else items[::-1]:
                    samples.setdefault((n, k), []).append(timed(f, args.calls))
        for (n, k), v in samples.items():
            table[(m, n, k)] = statistics.median(v)
        print(f"M={m} done", flush=True)
    kernels = list(kernels_for(1, weights["o"], "o"))
    lines = [f"# float32 linears per row count (`bench/linear_cpu.py`), {cpu_model()}", "",
             f"`{' '.join(['.venv/bin/python', 'bench/linear_cpu.py', *sys.argv[1:]])}` on {describe()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}, CPU flags "
             f"{'with' if 'avx512f' in build.cpu_flags().split() else 'without'} AVX-512, panels on the {isa} variant; "
             f"medians of {args.rounds} "
             "rounds. Step = 30 layers x (qkv + o + gate_up + down) + lm_head, in ms; weights hot in cache for "
             "the smaller shapes (a lower bound for a real step).", "",
             "| M | " + " | ".join(f"{k} step ms" for k in kernels) + " | panels vs mkl packed |",
             "|---" * (len(kernels) + 2) + "|"]
    for m in rows:
        step = {k: sum(table[(m, n, k)] * (1 if n == "lm_head" else LAYERS) for n in SHAPES) / 1e3 for k in kernels}
        lines.append(f"| {m} | " + " | ".join(f"{step[k]:.1f}" for k in kernels)
                     + f" | {step['mkl packed'] / step['panels']:.2f}x |")
    lines += ["", "Per call (us), by shape:", "", "| M | shape | " + " | ".join(kernels) + " |",
              "|---" * (len(kernels) + 2) + "|"]
    for m in rows:
        for n in SHAPES:
            lines.append(f"| {m} | {n} {SHAPES[n][0]}x{SHAPES[n][1]} | "
                         + " | ".join(f"{table[(m, n, k)]:.0f}" for k in kernels) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
