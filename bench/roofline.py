"""This machine's roofline for SmolLM2-135M decode and prefill: measured memory bandwidth and matmul throughput,
and the tokens/s bound they imply per workload.

    python bench/roofline.py [--threads 2] [--write-results]

Measured (median of 5, torch on --threads threads): read bandwidth (sum over 1 GiB), copy bandwidth, and
fp32/bf16 `mm` GFLOP/s at n = 1024 and 2048 (the peak) plus at the model's own decode shape
(32 x 576 @ 576 x 1536, what a batched decode step really runs); int8 x int8 -> int32 `torch._int_mm` GOP/s
(the arithmetic of --quantization w8a8_int8) at n = 1024 and 2048 and at the decode (32 rows) and prefill
(512 rows) shapes of the MLP's gate_up, 576 -> 1536 and 576 -> 3072.

Model (from the GGUF's shapes): 30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocab 49152
(tied). Per decode step of B requests at context L, in dtype of `w` bytes:
    bytes = 134.5 M weights * w  +  B * L * 30 layers * 2 (K, V) * 3 heads * 64 * w   (every weight and every
            cached K/V read once)
    flops = B * (2 * 134.5 M  +  30 layers * 4 * L * 9 heads * 64)                   (matmuls + attention)
    bound = B / max(bytes / bandwidth, flops / peak)   tokens/s
The int8 column reads 1-byte weights and a 2-byte KV cache (float16, the KV dtype of the int8 mode) against the
int8 peak. With --peers PATH (a bench/peers/run.py JSON), the measured 32-concurrent decode step of each radixgen
system in it (scheduler counters: forward seconds / decode steps, median over rounds) is set against the
32-concurrent step's int8 compute time: the share of the int8 compute bound that step reaches.
Writes bench/results/<stem>.md and <stem>.json, stem `roofline` unless --stem (bench/peers/report.py reads
the latter).

    python bench/roofline.py --int8-step [--rounds 3] [--bounds bench/results/roofline-avx512.json]

instead times --quantization w8a8_int8 in process (the model runner, eager, no scheduler): the forward of a
32-concurrent decode step (32 requests of 84 prompt tokens, then 64 decode steps timed one by one: the median
step) and the prefill of one 1,000-token prompt, with its int8 linears on each kernel of kernels/quant/w8a8.py
("torch": quantization, torch._int_mm, dequantization as torch ops; "fused": kernels/cpu's fused w8a8_linear at
every row count; "int_mm": kernels/cpu's w8a8_int_mm at every row count; "native": what the mode runs, the fused op
below the weight's int_mm_rows and w8a8_int_mm from there; --kernels picks them),
alternating rounds, medians; the step is set against the int8 compute time of the --bounds JSON (this script's
own output). Writes bench/results/<stem>.md (stem `int8_step` unless --stem).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def cpu_model() -> str:
    """This CPU's model name and its bf16/AMX/AVX-512 flags as /proc/cpuinfo gives them (results name their machine)."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
           if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX2'})"

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 30, 576, 9, 3, 64, 1536, 49152
LAYER_PARAMS = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * MLP
PARAMS = LAYERS * LAYER_PARAMS + VOCAB * HIDDEN  # the tied embedding is read once, as the lm_head


def _median(f, runs: int = 5) -> float:  # noqa: ANN001
    f()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure() -> dict:
    big = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(big)
    res = {
        "read_GBps": big.numel() * 4 / _median(lambda: big.sum()) / 1e9,
        "copy_GBps": 2 * big.numel() * 4 / _median(lambda: dst.copy_(big)) / 1e9,
    }
    big = dst = None  # free the 2 GiB before the matmuls
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for n in (1024, 2048):
            a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
            res[f"{name}_mm{n}_GFLOPs"] = 2 * n**3 / _median(lambda a=a, b=b: torch.mm(a, b)) / 1e9
        x, w = torch.randn(32, HIDDEN, dtype=dt), torch.randn(HIDDEN, MLP, dtype=dt)
        t = _median(lambda x=x, w=w: [torch.mm(x, w) for _ in range(100)]) / 100
        res[f"{name}_decode_shape_GFLOPs"] = 2 * 32 * HIDDEN * MLP / t / 1e9
        res[f"{name}_peak_GFLOPs"] = max(res[f"{name}_mm1024_GFLOPs"], res[f"{name}_mm2048_GFLOPs"])
    res.update(measure_int8())
    return res


INT8_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (32, HIDDEN, MLP), (32, HIDDEN, 2 * MLP),
               (512, HIDDEN, MLP), (512, HIDDEN, 2 * MLP)]


def measure_int8() -> dict:
    """`torch._int_mm` (int8 [M, K] x int8 [K, N] -> int32; oneDNN, VNNI/AMX where the CPU has them) in GOP/s."""
    res = {}
    for m, k, n in INT8_SHAPES:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-127, 128, (k, n), dtype=torch.int8)
        reps = max(1, int(2e9 // (2 * m * k * n)))  # ~2 GOP per timed call: small shapes repeat
        t = _median(lambda a=a, b=b, reps=reps: [torch._int_mm(a, b) for _ in range(reps)]) / reps
        res[f"int8_{m}x{k}x{n}_GOPs"] = 2 * m * k * n / t / 1e9
    res["int8_peak_GFLOPs"] = max(res[f"int8_{m}x{k}x{n}_GOPs"] for m, k, n in INT8_SHAPES)
    return res


def bound(m: dict, dtype: str, batch: int, ctx: int) -> dict:
    """Tokens/s bound of a decode step (batch requests, ctx tokens of context each) and which roof binds."""
    w = {"fp32": 4, "bf16": 2, "int8": 1}[dtype]
    kv = batch * ctx * LAYERS * 2 * KV_HEADS * HEAD_DIM * max(w, 2)
    nbytes = PARAMS * w + kv
    flops = batch * (2 * PARAMS + LAYERS * 4 * ctx * HEADS * HEAD_DIM)
    t_mem, t_flop = nbytes / (m["read_GBps"] * 1e9), flops / (m[f"{dtype}_peak_GFLOPs"] * 1e9)
    return {
        "tok_s": batch / max(t_mem, t_flop),
        "bound": "memory" if t_mem >= t_flop else "compute",
        "bytes_per_step_MB": nbytes / 1e6,
        "gflop_per_step": flops / 1e9,
        "step_ms": 1e3 * max(t_mem, t_flop),
        "compute_ms": 1e3 * t_flop,
    }


def prefill_bound(m: dict, dtype: str) -> float:
    return m[f"{dtype}_peak_GFLOPs"] * 1e9 / (2 * PARAMS)


CASES = [
    ("single stream (B=1, 512 ctx)", 1, 576),
    ("8 concurrent (84 + 64 ctx)", 8, 148),
    ("32 concurrent (84 + 64 ctx)", 32, 148),
    ("64 concurrent (84 + 64 ctx)", 64, 148),
    ("RAG, 16 in flight (1,600 ctx)", 16, 1600),
]


def markdown(m: dict, threads: int) -> str:
    lines = [
        "# Roofline of this machine for SmolLM2-135M (`bench/roofline.py`)",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
        f"{threads} threads, median of 5, on {cpu_model()}. "
        f"`python bench/roofline.py {' '.join(sys.argv[1:])}`",
        "",
        "| measurement | value |",
        "|---|---:|",
        f"| read bandwidth (sum over 1 GiB) | {m['read_GBps']:.1f} GB/s |",
        f"| copy bandwidth (read + write) | {m['copy_GBps']:.1f} GB/s |",
    ]
    for name in ("fp32", "bf16"):
        lines.append(
            f"| {name} mm n=1024 / 2048 | {m[f'{name}_mm1024_GFLOPs']:.0f} / "
            f"{m[f'{name}_mm2048_GFLOPs']:.0f} GFLOP/s |"
        )
        lines.append(
            f"| {name} mm at the decode shape 32x576 @ 576x1536 | "
            f"{m[f'{name}_decode_shape_GFLOPs']:.0f} GFLOP/s |"
        )
    for m_, k, n in INT8_SHAPES:
        lines.append(f"| int8 `_int_mm` {m_}x{k} @ {k}x{n} | {m[f'int8_{m_}x{k}x{n}_GOPs']:.0f} GOP/s |")
    lines += [
        "",
        f"Model: {PARAMS / 1e6:.1f} M parameters read per decode step (the tied embedding as the lm_head).",
        "",
        "| decode case | fp32 bound tok/s | bf16 bound tok/s | int8 bound tok/s | binding roof (bf16 / int8) |",
        "|---|---:|---:|---:|---|",
    ]
    for label, b, ctx in CASES:
        f, h, q = bound(m, "fp32", b, ctx), bound(m, "bf16", b, ctx), bound(m, "int8", b, ctx)
        lines.append(f"| {label} | {f['tok_s']:.0f} | {h['tok_s']:.0f} | {q['tok_s']:.0f} | "
                     f"{h['bound']} / {q['bound']} |")
    lines.append(
        f"| prefill (compute) | {prefill_bound(m, 'fp32'):.0f} | {prefill_bound(m, 'bf16'):.0f} | "
        f"{prefill_bound(m, 'int8'):.0f} | compute |"
    )
    return "\n".join(lines) + "\n"


def c32_step_share(m: dict, peers_path: str) -> list[dict]:
    """Per radixgen system in a bench/peers/run.py JSON: its measured c32 decode step (forward seconds per timed
    decode step, median over rounds) against the int8 compute time of a 32-row step at 148 tokens of context."""
    with open(peers_path) as f:
        doc = json.load(f)
    ideal = bound(m, "int8", 32, 148)
    out = []
    for name in doc["systems"]:
        steps = [r["sched"] for r in doc["runs"]
                 if r["system"] == name and r["workload"] == "c32" and r.get("sched", {}).get("decode_steps_timed")]
        if not steps:
            continue
        ms = statistics.median(1e3 * s["decode_forward_s_total"] / s["decode_steps_timed"] for s in steps)
        out.append({"system": name, "step_ms": ms, "int8_compute_ms": ideal["compute_ms"],
                    "int8_bound_ms": ideal["step_ms"], "share": ideal["compute_ms"] / ms, "rounds": len(steps)})
    return out


def share_markdown(rows: list[dict], peers_path: str) -> str:
    lines = [
        "",
        f"32-concurrent decode step against the int8 compute bound (`--peers {os.path.relpath(peers_path, ROOT)}`; "
        "measured: scheduler forward seconds / timed decode steps in the c32 workload, median over rounds; "
        "bound: 32 rows x 148 tokens of context at the int8 peak):",
        "",
        "| system | measured step ms | int8 compute ms | int8 bound ms (max of memory, compute) | share of int8 compute bound |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['system']} | {r['step_ms']:.1f} | {r['int8_compute_ms']:.1f} | {r['int8_bound_ms']:.1f} | "
                     f"{100 * r['share']:.0f} % |")
    return "\n".join(lines) + "\n"


def _int8_runner():  # noqa: ANN202 - runtime types stay out of this script's imports until asked for
    sys.path.insert(0, ROOT)
    from runtime.config import make_config
    from runtime.executor.model_runner import create_model_runner

    cfg = make_config(quantization="w8a8_int8", disable_compile=True, max_total_tokens=8192,
                      max_running_requests=40, chunked_prefill_size=-1)
    return create_model_runner(cfg)


def _c32_step_ms(runner, steps: int = 64) -> float:  # noqa: ANN001
    from runtime.executor.greedy import OfflineBatch

    prompts = [[(i * 31 + b * 977) % 40000 + 100 for i in range(84)] for b in range(32)]
    batch = OfflineBatch(runner, prompts)
    try:
        batch.extend(prompts)
        nxt = [[1] for _ in range(32)]
        batch.extend(nxt, is_decode=True)  # warm-up step
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            batch.extend(nxt, is_decode=True)
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)
    finally:
        batch.release()


def _prefill_s(runner, n: int = 1000) -> float:  # noqa: ANN001
    from runtime.executor.greedy import OfflineBatch

    ids = [(i * 7919) % 40000 + 100 for i in range(n)]
    batch = OfflineBatch(runner, [ids])
    try:
        t = time.perf_counter()
        batch.extend([ids])
        return time.perf_counter() - t
    finally:
        batch.release()


def int8_step(threads: int, rounds: int, bounds_path: str, kernels: list[str]) -> str:
    """The --int8-step table (module doc), markdown."""
    from kernels.quant.w8a8 import W8A8Weight

    runner = _int8_runner()
    weights = [w for w in runner.model.modules() if isinstance(w, W8A8Weight)]
    with open(bounds_path) as f:
        ideal = bound(json.load(f), "int8", 32, 148)
    res: dict[str, dict[str, list[float]]] = {k: {"step": [], "prefill": []} for k in kernels}
    for _ in range(rounds):
        for kernel, r in res.items():
            for w in weights:
                w.set_kernel(kernel)
            _prefill_s(runner, 64)  # warm-up
            r["step"].append(_c32_step_ms(runner))
            r["prefill"].append(_prefill_s(runner))
    lines = ["# --quantization w8a8_int8 in process: 32-concurrent decode step and 1,000-token prefill per int8 kernel",
             "", f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
             f"{threads} threads, eager, {rounds} alternating rounds, medians, on {cpu_model()}. "
             f"{len(weights)} int8 linears. Command: `python bench/roofline.py {' '.join(sys.argv[1:])}`", "",
             "| int8 kernel | c32 decode step ms (forward, 84 + 64 ctx) | int8 compute ms | share of int8 compute "
             "bound | 1,000-token prefill s | prefill tok/s |", "|---|---:|---:|---:|---:|---:|"]
    for kernel, r in res.items():
        step, pre = statistics.median(r["step"]), statistics.median(r["prefill"])
        lines.append(f"| {kernel} | {step:.1f} | {ideal['compute_ms']:.1f} | {100 * ideal['compute_ms'] / step:.0f} % "
                     f"| {pre:.2f} | {1000 / pre:.0f} |")
    lines += ["", "Raw: " + "; ".join(f"{k} step ms {[round(v, 1) for v in r['step']]}, prefill s "
                                      f"{[round(v, 2) for v in r['prefill']]}" for k, r in res.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--stem", default="roofline",
                    help="results file names: bench/results/<stem>.md and .json (one per machine kind)")
    ap.add_argument("--peers", default=None,
                    help="a bench/peers/run.py JSON: set its radixgen systems' c32 decode step against the int8 bound")
    ap.add_argument("--int8-step", action="store_true", help="time w8a8_int8's step and prefill per int8 kernel")
    ap.add_argument("--kernels", default="torch,fused,native", help="--int8-step: the int8 kernels to alternate")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bounds", default=os.path.join(RESULTS, "roofline-avx512.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.int8_step:
        md = int8_step(args.threads, args.rounds, args.bounds, args.kernels.split(","))
        print(md)
        if args.write_results:
            with open(os.path.join(RESULTS, (args.stem if args.stem != "roofline" else "int8_step") + ".md"), "w") as f:
                f.write(md)
        return
    m = measure()
    md = markdown(m, args.threads)
    shares = c32_step_share(m, args.peers) if args.peers else []
    if shares:
        md += share_markdown(shares, args.peers)
    print(md)
    if args.write_results:
        with open(os.path.join(RESULTS, args.stem + ".json"), "w") as f:
            json.dump({"threads": args.threads, "cpu": cpu_model(), **m, "c32_step_share": shares}, f, indent=1)
        with open(os.path.join(RESULTS, args.stem + ".md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
