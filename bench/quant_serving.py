"""One question: what do quantized weights buy radixgen's serving speed, next to llama-server on the same file?

Systems (all up at once, each on its own 127.0.0.1 port, 2 threads): radixgen (--dtype auto unless --dtype)
with --quantization none (dense weights in that dtype), int8 and auto (the GGUF's Q4_1 codes kept, int4 kernel;
`--modes auto:torch,auto` adds --quantization-kernel torch, i.e. torch's weight-only kernels instead of native),
and llama-server (bench/peers set-up, bench/.peers/llama-build) on the same Q4_1 GGUF. Workloads from
bench/peers/workloads.py: `single` (512-token prompt, 128 greedy tokens: decode tokens/s), c8 and c32 (8/32
concurrent clients, 84-token prompts, 128 tokens: output tokens/s). Rounds alternate systems (A B C D A B C D ...) with a fresh seed each round; medians.
Weights memory: radixgen's start-up log line, llama-server's "model buffer size" lines. Writes
bench/results/quant_serving.json and prints the table (bench/results/quant.md quotes it).

    flock /tmp/radixgen-bench.lock python bench/quant_serving.py [--rounds 3] [--base-port 32210]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))

from run import run_workload, warm_up  # noqa: E402
from systems import MODEL_NAME, ROOT, HttpSystem, System, default_gguf, make_systems  # noqa: E402

MODES = ["none", "int8", "auto"]
WORKLOADS = ["single", "c8", "c32"]


def radixgen(mode: str, port: int, gguf: str, dtype: str) -> HttpSystem:
    """mode: a --quantization value, optionally with a --quantization-kernel after a colon ("auto:torch") and a
    --kv-cache-dtype after a second one ("auto::float32": the default kernel, a float32 KV cache)."""
    quantization, kernel, kv = (mode.split(":") + ["", ""])[:3]
    cmd = [sys.executable, "-m", "server", "serve", "--compile-mode", "sync", "--model-path", gguf, "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", MODEL_NAME, "--dtype", dtype, "--num-threads", "2",
           "--quantization", quantization] + (["--quantization-kernel", kernel] if kernel else []) + (
           ["--kv-cache-dtype", kv] if kv else [])
    env = {"OMP_NUM_THREADS": "2", "PYTHONPATH": ROOT}
    name = f"radixgen-{quantization}" + (f"-{kernel}" if kernel else "") + (f"-kv{kv}" if kv else "")
    return HttpSystem(name, cmd=cmd, env=env, port=port, version_of=f"radixgen {dtype} {mode}")


def weights_mb(s: System) -> float | None:
    text = ""
    if s.log_path and os.path.exists(s.log_path):
        with open(s.log_path) as fh:
            text = fh.read()
    m = re.search(r"weights: ([\d.]+) MB", text)
    if m:
        return float(m.group(1))
    bufs = re.findall(r"model buffer size\s*=\s*([\d.]+) MiB", text)
    return sum(float(b) for b in bufs) if bufs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base-port", type=int, default=32210)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="a subset of single,c8,c32")
    ap.add_argument("--dtype", default="auto", help="radixgen's --dtype (auto: bf16 where the CPU has native "
                    "bf16 math, else float32)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quant_serving.json"))
    args = ap.parse_args()
    gguf = default_gguf()
    modes = args.modes.split(",")
    workloads = args.workloads.split(",")
    systems: list[System] = [radixgen(m, args.base_port + i, gguf, args.dtype) for i, m in enumerate(modes)]
    if not args.no_llama:
        systems += make_systems(["llama-server"], args.base_port + 20, gguf)
    results: dict[str, dict[str, list[dict]]] = {s.name: {w: [] for w in workloads} for s in systems}
    try:
        for s in systems:
            s.start()
            warm_up(s)
            print(f"up: {s.name} ({s.version}), weights {weights_mb(s)} MB", flush=True)
        for r in range(args.rounds):
            for w in workloads:
                for s in systems:
                    res = run_workload(s, w, seed=100 + r, rag_questions=0, hf_rag_questions=0)
                    results[s.name][w].append(res)
                    key = "decode_tok_s" if w == "single" else "out_tok_s"
                    print(f"round {r} {w:6s} {s.name:16s} {res.get(key, float('nan')):8.1f} tok/s "
                          f"ok {res['ok']}/{res['requests']}", flush=True)
        mem = {s.name: weights_mb(s) for s in systems}
        if mem.get("llama-server") is None and "llama-server" in mem:  # newer builds log no buffer sizes
            mem["llama-server"] = f"{os.path.getsize(gguf) / 2**20:.1f} (the file; mmapped)"
    finally:
        for s in systems:
            s.stop()
    table = {}
    for s in systems:
        row = {"weights_mb": mem[s.name], "version": s.version}
        for w in workloads:
            key = "decode_tok_s" if w == "single" else "out_tok_s"
            row[w] = statistics.median(x.get(key, 0.0) for x in results[s.name][w])
        table[s.name] = row
    with open(args.out, "w") as fh:
        json.dump({"table": table, "raw": results}, fh, indent=1, default=str)
    ref = table.get("llama-server")
    heads = {"single": "single decode tok/s", "c8": "c8 out tok/s", "c32": "c32 out tok/s"}
    print("\n| system | weights MB | " + " | ".join(heads[w] for w in workloads) + " |")
    print("|---|---:|" + "---:|" * len(workloads))
    for name, row in table.items():
        cells = []
        for w in workloads:
            ratio = f" ({row[w] / ref[w]:.2f}x)" if ref and ref[w] else ""
            cells.append(f"{row[w]:.1f}{ratio}")
        print(f"| {name} | {row['weights_mb']} | " + " | ".join(cells) + " |")
    if ref:  # rounds alternate systems, so round r's figures were taken minutes apart: ratios within a round
        print("\nper-round ratios vs llama-server (median of the paired ratios):")
        for name in table:
            for w in workloads:
                key = "decode_tok_s" if w == "single" else "out_tok_s"
                pairs = [a.get(key, 0.0) / b[key] for a, b in zip(results[name][w], results["llama-server"][w],
                                                                  strict=True) if b.get(key)]
                if pairs and name != "llama-server":
                    print(f"  {name} {w}: {', '.join(f'{x:.2f}' for x in pairs)} -> {statistics.median(pairs):.2f}x")


if __name__ == "__main__":
    main()
