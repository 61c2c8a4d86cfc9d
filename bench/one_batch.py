"""One question: how fast is one forward of the engine core, without the scheduler?

Prefill tokens/s for a 512-token prompt and decode tokens/s at batch 1, 8 and 32 (each request holding a
512-token context), in float32 and bfloat16, median of N runs. Writes bench/results/one_batch.md.
Every configuration is built first, then the runs alternate between them (run 1 of each, run 2 of each, ...)
so a shared machine's load hits them alike.

    python bench/one_batch.py [--runs 5] [--dtypes float32 bfloat16] [--device cpu] [--decode-steps 16]
                              [--cuda-graph on off]   (CUDA: decode with captured graphs and eagerly, side by side)
                              [--compile on off]      (CPU: compiled decode graphs and eager, side by side)
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

from runtime.config import make_config  # noqa: E402
from runtime.executor.greedy import OfflineBatch  # noqa: E402
from runtime.executor.model_runner import create_model_runner  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_prefill(runner, prompt_len: int, device: str) -> float:
    ids = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
    batch = OfflineBatch(runner, [ids])
    try:
        t = time.perf_counter()
        batch.extend([ids])
        _sync(device)
        return prompt_len / (time.perf_counter() - t)
    finally:
        batch.release()


def bench_decode(runner, bs: int, ctx: int, steps: int, runs: int, device: str) -> list[float]:
    """Prefill bs contexts once, then `runs` timed runs of `steps` decode steps each; tokens/s per run."""
    prompts = [[(i * 31 + b * 977) % 40000 + 100 for i in range(ctx)] for b in range(bs)]
    batch = OfflineBatch(runner, prompts)
    try:
        batch.extend(prompts)
        nxt = [[1] for _ in range(bs)]
        batch.extend(nxt, is_decode=True)  # warm-up step
        out = []
        for _ in range(runs):
            _sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                batch.extend(nxt, is_decode=True)
            _sync(device)
            out.append(bs * steps / (time.perf_counter() - t))
        return out
    finally:
        batch.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--cuda-graph", nargs="+", default=["on"], choices=["on", "off"],
                    help="CUDA only: decode through captured graphs (on) and/or eagerly (off)")
    ap.add_argument("--compile", nargs="+", default=["on"], choices=["on", "off"],
                    help="CPU only: decode through torch.compile'd graphs (on) and/or eagerly (off)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "one_batch.md"))
    args = ap.parse_args()
    modes = args.cuda_graph if args.device == "cuda" else args.compile
    what = "graphs" if args.device == "cuda" else "compile"
    runners = []
    for dtype, mode in [(d, m) for d in args.dtypes for m in modes]:
        cfg = make_config(dtype=dtype, device=args.device, max_total_tokens=(args.prompt_len + 64) * 34 * 2,
                          max_running_requests=40, chunked_prefill_size=-1, disable_cuda_graph=mode == "off",
                          disable_compile=mode == "off", compile_max_bs=max(args.batch_sizes))
        t = time.perf_counter()
        runner = create_model_runner(cfg, progress=True)
        print(f"{dtype}, {what} {mode}: start-up {time.perf_counter() - t:.1f} s", flush=True)
        bench_prefill(runner, 64, args.device)  # warm-up
        runners.append((f"{dtype}, {what} {mode}", runner))
    samples: dict[str, dict[str, list[float]]] = {label: {} for label, _ in runners}
    for _ in range(args.runs):
        for label, runner in runners:
            samples[label].setdefault("prefill", []).append(bench_prefill(runner, args.prompt_len, args.device))
            for bs in args.batch_sizes:
                dec = bench_decode(runner, bs, args.prompt_len, args.decode_steps, 1, args.device)
                samples[label].setdefault(f"decode_bs{bs}", []).extend(dec)
    rows = []
    for label, _ in runners:
        row = {"dtype": label, **{k: statistics.median(v) for k, v in samples[label].items()}}
        rows.append(row)
        print(row, flush=True)
    head = ["dtype", f"prefill tok/s ({args.prompt_len})"] + [f"decode tok/s bs={b}" for b in args.batch_sizes]
    lines = ["# bench/one_batch.py", "",
             f"Machine: {describe()}, torch {torch.__version__}, "
             f"threads {torch.get_num_threads()}, device {args.device}. Median of {args.runs} runs; decode "
             f"requests each hold a {args.prompt_len}-token context.", "",
             "Command: `python bench/one_batch.py " + " ".join(sys.argv[1:]) + "`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vals = [r["dtype"], f"{r['prefill']:.0f}"] + [f"{r[f'decode_bs{b}']:.1f}" for b in args.batch_sizes]
        lines.append("| " + " | ".join(vals) + " |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
