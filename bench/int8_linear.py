"""One question: per row count M, which arithmetic runs SmolLM2's linears fastest on this CPU, counting everything a
W8A8 call pays (per-token dynamic activation quantization, the int8 x int8 -> int32 product, the dequantization)?

Candidates, each y = x @ W^T for float32 x [M, K], W [N, K]:
  fp32 mm       F.linear on float32 (MKL sgemm; the default path on CPUs without native bf16)
  bf16 mm       F.linear on bfloat16 (oneDNN; x cast in and y cast out)
  int_mm eager  per-token absmax quantization of x in torch ops, torch._int_mm (oneDNN int8 GEMM, VNNI/AMX where
                the CPU has them), y = acc * sx * sw
  int_mm comp.  the same under torch.compile (inductor fuses the quantization and the dequantization passes)
  int8 fused    kernels/cpu's w8a8_linear: the same per-token quantization, int8 product (vpdpbusd on codes
                packed at load) and dequantization in one native call (kernels/quant/w8a8.py's native kernel)
  int_mm core   torch._int_mm alone on codes quantized beforehand, weight codes [K, N] contiguous (the twin's
                layout): oneDNN's int8 GEMM core, no quantization or dequantization (a ceiling, not a W8A8 call)
  int_mm core T the same on a transposed view of [N, K] codes
  hybrid        kernels/cpu's w8a8_int_mm: native per-token quantization, torch._int_mm on the [K, N] codes, native
                epilogue (dequantization in place) in one op call (kernels/quant/w8a8.py's large-row kernel)
  hybrid T      the same on a transposed view of [N, K] codes
  fused +F / hybrid +F  with --float-channels F: the two native ops with F input channels in float (the down
                projection's outlier channels under --quantization w8a8_int8: fma per channel in the epilogue)
  int4 w-only   the small-batch kernel of --quantization gguf on this CPU (4-bit codes, group 32, kernels.quant's
                CPU layout: torch's int4pack kernel on bfloat16 activations, or kernels/cpu's on AVX2-only CPUs)
  qlinear       torch.ops.onednn.qlinear_pointwise on a prepacked weight; one activation scale per call (oneDNN's
                op takes a per-tensor activation scale, so this is an upper bound on speed, not a per-token
                path); `qlinear core` the same on codes quantized beforehand
Per shape and M: microseconds per call (median of alternating rounds, each round --calls back-to-back calls) and
the effective G(FL)OP/s 2 M N K / t.

    .venv/bin/python bench/int8_linear.py [--rounds 5] [--rows 1,4,...] [--only "int8 fused,int_mm eager"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine import cpuinfo, describe  # noqa: E402  (bench/ is the script directory)

from kernels.cpu import ops as cpu_ops  # noqa: E402
from kernels.quant import quantize, to_kernel  # noqa: E402

INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16", "amx_bf16")

# (N, K) of the model's linears: q/o, k/v, fused qkv, gate/up (one and fused), down, lm_head
SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "qkv": (960, 576), "up": (1536, 576), "gate_up": (3072, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}


def dyn_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: x [M, K] float32 -> (q int8 [M, K], scale float32 [M, 1])."""
    s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(x / s).to(torch.int8), s


def w8a8(x: torch.Tensor, wt: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K]; wt int8 [K, N]; sw float32 [N] -> float32 [M, N]."""
    q, sx = dyn_quant(x)
    return torch._int_mm(q, wt) * sx * sw


def qlinear_fns(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """oneDNN's qlinear on a prepacked int8 weight: with a per-tensor activation scale computed each call (torch
    ops), and on codes quantized beforehand (its core: the int8 GEMM with the dequantization fused)."""
    try:
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        zero = torch.zeros(w.shape[0], dtype=torch.int64)
        zp = torch.zeros((), dtype=torch.int64)

        def call(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return torch.ops.onednn.qlinear_pointwise.tensor(
                q, s, zp, packed, sw, zero, None, 1.0, 0, torch.float32, "none", [], "")

        def run() -> torch.Tensor:
            s = x.abs().amax().clamp_min(1e-8) / 127.0
            return call(torch.round(x / s).to(torch.int8), s)
        s0 = x.abs().amax().clamp_min(1e-8) / 127.0
        q0 = torch.round(x / s0).to(torch.int8)
        run()
        return {"qlinear (per-tensor)": run, "qlinear core": lambda: call(q0, s0)}
    except Exception as e:  # noqa: BLE001 - report the candidate as unavailable, with why
        print(f"qlinear unavailable: {str(e).splitlines()[0]}", file=sys.stderr)
        return {}


def candidates(m: int, n: int, k: int, compiled: Callable, qlinear: bool, wanted: Callable[[str], bool],
               nf: int = 0) -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    sw = w.abs().amax(dim=1) / 127.0
    wq = torch.round(w / sw[:, None]).to(torch.int8)
    wt = wq.t().contiguous()
    wb, xb = w.bfloat16(), x.bfloat16()
    w4 = to_kernel(quantize(w, "int4", 32), "cpu") if wanted("int4 w-only") else None
    wp, colsum = cpu_ops.pack_vnni(wt)
    q, _ = dyn_quant(x)
    out: dict[str, Callable[[], torch.Tensor]] = {
        "int8 fused": lambda: cpu_ops.w8a8_linear(x, wp, colsum, sw),
        "int_mm core": lambda: torch._int_mm(q, wt),
        "int_mm core T": lambda: torch._int_mm(q, wq.t()),
        "hybrid": lambda: cpu_ops.w8a8_int_mm(x, wt, sw),
        "hybrid T": lambda: cpu_ops.w8a8_int_mm(x, wq.t(), sw),
        "int4 w-only": lambda: w4(x) if w4 is not None else x,
        "fp32 mm": lambda: F.linear(x, w),
        "bf16 mm": lambda: F.linear(xb, wb).float(),
        "int_mm eager": lambda: w8a8(x, wt, sw),
        "int_mm comp.": lambda: compiled(x, wt, sw),
    }
    if qlinear:
        out.update(qlinear_fns(x, wq, sw))
    if nf:
        fidx, wf = torch.randperm(k, generator=g)[:nf].sort().values, torch.randn(nf, n, generator=g) * 0.05
        out["fused +F"] = lambda: cpu_ops.w8a8_linear(x, wp, colsum, sw, None, fidx, wf)
        out["hybrid +F"] = lambda: cpu_ops.w8a8_int_mm(x, wt, sw, None, fidx, wf)
    return out


def timed(fn: Callable[[], torch.Tensor], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--qlinear", action="store_true", help="also time oneDNN's qlinear_pointwise")
    ap.add_argument("--float-channels", type=int, default=0, help="also time the native ops with this many "
                    "float input channels (fused +F, hybrid +F)")
    ap.add_argument("--only", default=None, help="comma-separated candidate names to time (default: all)")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--isa", default="auto", help="the kernels/cpu variant the native ops run (avx512, avx2, "
                    "portable; with ONEDNN_MAX_CPU_ISA=AVX2 in the environment too, what an AVX2-only CPU runs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_ops.load()
    isa_variant = cpu_ops.cpu_isa(args.isa)
    compiled = torch.compile(w8a8, dynamic=True)
    only = args.only.split(",") if args.only else None

    def wanted(c: str) -> bool:
        return (only is None or c in only or (c.startswith("qlinear") and args.qlinear)
                or (c.endswith("+F") and args.float_channels > 0))
    flags = set(cpuinfo("flags").split())
    isa = ", ".join(f for f in INT8_FLAGS if f in flags) or "none"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    lines = [f"# int8 W8A8 vs float linears on {describe()}", "", f"int8 ISA flags: {isa}; kernels/cpu variant "
             f"{isa_variant}; oneDNN " + (f"held to ONEDNN_MAX_CPU_ISA={onednn}" if onednn else "unrestricted"), "",
             f"torch {torch.__version__}, {args.threads} threads, {args.rounds} alternating rounds x {args.calls} "
             "calls, medians. Cells: microseconds per call (G(FL)OP/s). Command: `" + "".join(
                 f"{v}={os.environ[v]} " for v in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS") if v in os.environ)
             + "bench/int8_linear.py "
             + " ".join(sys.argv[1:]) + "`", ""]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        lines += [f"## {name}: N={n} K={k}", ""]
        header = None
        for m in (int(r) for r in args.rows.split(",")):
            cands = {c: f for c, f in candidates(m, n, k, compiled, args.qlinear, wanted,
                                                     args.float_channels).items() if wanted(c)}
            for fn in cands.values():  # warm-up (and compile for this shape)
                fn()
                fn()
            times: dict[str, list[float]] = {c: [] for c in cands}
            for _ in range(args.rounds):
                for c, fn in cands.items():
                    times[c].append(timed(fn, args.calls))
            med = {c: statistics.median(v) for c, v in times.items()}
            if header is None:
                header = list(cands)
                lines += ["| M | " + " | ".join(header) + " | best |", "|---" * (len(header) + 2) + "|"]
            cells = [f"{med[c]:.0f} ({2 * m * n * k / med[c] / 1e3:.0f})" for c in header]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {min(med, key=med.__getitem__)} |")
            print(lines[-1], flush=True)
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
