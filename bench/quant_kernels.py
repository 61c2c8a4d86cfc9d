"""One question: per batch size, which CPU linear is fastest on SmolLM2's shapes: dense float32, dense bfloat16,
torch._weight_int8pack_mm (int8 per channel), torch._weight_int4pack_mm_for_cpu (int4, group 32), or kernels/cpu's
native block GEMVs (q8: int8 blocks of 32, q4: Q4_1 blocks; float32 activations rounded to int8 per block)?

Each round times every (shape, M, kernel) once, alternating kernels inside a round; medians over rounds of the
per-call time (each timing = --calls back-to-back calls). Prints a table of microseconds per call summed over
one layer's four linears and the lm_head.

    flock /tmp/radixgen-bench.lock python bench/quant_kernels.py [--rounds 7] [--threads 2] [--isa avx512]

--isa forces the ISA variant of the native kernels (kernels/cpu/isa.h; default: the start-up choice).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.cpu import ops  # noqa: E402
from kernels.quant import PanelWeight, linear, quantize, set_cpu_kernel, to_kernel  # noqa: E402
from kernels.quant.cpu_blocks import native_available  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--isa", default="auto", help="ISA variant of the native kernels (avx512, avx2, portable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"native kernels: the {ops.cpu_isa(args.isa)} variant")
    g = torch.Generator().manual_seed(0)
    weights = {}
    # panels: float32 in kernels/cpu/linear.cpp's column panels (the dense copies' form where they are preferred)
    kinds = ["fp32", "bf16", "int8", "int4"] + (["panels"] if ops.panels_native() else []) + (
        ["q8", "q4"] if native_available() else [])
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.05
        set_cpu_kernel("torch")
        weights[name] = {"fp32": w, "bf16": w.bfloat16(), "int8": to_kernel(quantize(w, "int8", 0), "cpu"),
                         "int4": to_kernel(quantize(w, "int4", 32), "cpu")}
        if "panels" in kinds:
            weights[name]["panels"] = PanelWeight(w)
        if "q4" in kinds:
            set_cpu_kernel("native")
            weights[name] |= {"q8": to_kernel(quantize(w, "int8", 0), "cpu"),
                              "q4": to_kernel(quantize(w, "int4", 32), "cpu")}
    times: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for m in map(int, args.batches.split(",")):
            for name, (_, k) in SHAPES.items():
                for kind in kinds:
                    x = torch.randn(m, k, generator=g).to(torch.bfloat16 if kind in ("bf16", "int8", "int4")
                                                           else torch.float32)
                    w = weights[name][kind]
                    linear(x, w)
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        linear(x, w)
                    times.setdefault((name, m, kind), []).append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"threads {args.threads}, {args.rounds} rounds x {args.calls} calls, median us per call")
    print("| M | linear | " + " | ".join(kinds) + " |\n|---|---|" + "---:|" * len(kinds))
    for m in map(int, args.batches.split(",")):
        layer = {kind: 0.0 for kind in kinds}
        for name in SHAPES:
            med = {kind: statistics.median(times[(name, m, kind)]) for kind in kinds}
            if name != "lm_head":
                for kind in kinds:
                    layer[kind] += med[kind]
            else:
                print(f"| {m} | layer (qkv+o+gate_up+down) | " + " | ".join(f"{layer[x]:.0f}" for x in kinds) + " |")
                print(f"| {m} | lm_head | " + " | ".join(f"{med[x]:.0f}" for x in kinds) + " |")


if __name__ == "__main__":
    main()
