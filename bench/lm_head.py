"""A tied Q8_0 lm_head on CPU (Gemma 3 270M: [262144, 640]; SmolLM2: [49152, 576]), and sampling over its logits.

    python bench/lm_head.py [--gguf PATH[,PATH]] [--rows 1,8,32] [--reps 7]

Head variants, each x [M, H] float32 -> logits [M, V], median wall time of `--reps` calls after one warm-up,
and the relative error max|y - y_exact| / max|y_exact| against float32 x @ W^T on the file's exact values:
  dense_f32     F.linear on a float32 copy of the whole table (what --quantization-dense-rows kept for >= 8 rows)
  q8_native     kernels/cpu q8_linear on the Q8_0 codes and float16 block scales as stored, x rounded to int8 per
                block of 32 (the head radixgen runs now, at every row count, no copy)
  int8_torch    torch._weight_int8pack_mm: codes re-rounded to one scale per row (torch's kernel has no groups),
                x in bfloat16 (the head before, on AVX-512 CPUs)
  int8_torch_2  the same kernel on two per-row terms (codes and the codes of their remainder): block scales
                kept (--quantization-kernel torch)
  w8a8_int_mm   torch._int_mm on per-row codes with x quantized per token (kernels/quant/w8a8.py)
Sampling: the whole sampler (`sample`) on [M, V] random logits (flat, and peaked as a language model's), per
filter setting, with the candidate path (after: top-k rows, and top-p rows whose nucleus lies in the top 256)
and with it off (before: softmax, thresholds and inverse CDF over the whole vocabulary).
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

from machine import describe  # noqa: E402

from kernels import quant  # noqa: E402
from kernels.cpu import ops as cpu_ops  # noqa: E402
from kernels.quant import gguf_blocks, rtn  # noqa: E402
from kernels.quant.cpu_blocks import Q8BlockWeight  # noqa: E402
from kernels.quant.w8a8 import int8_codes, w8a8_mm  # noqa: E402


def _time(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, torch.Tensor]:
    y = fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), y


def load_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The GGUF's token_embd (Q8_0) as codes int8 [V, H] and float32 block scales [V, H / 32]."""
    from runtime import gguf_file

    reader = gguf_file.reader(path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if t.tensor_type.name != "Q8_0":
        raise SystemExit(f"token_embd is {t.tensor_type.name}, this bench reads Q8_0")
    b = gguf_blocks.unpack(t.data.reshape(int(t.shape[1]), -1), "Q8_0")
    return torch.from_numpy(b.codes.copy()), torch.from_numpy(b.params["d"].astype("float32"))


def head_variants(codes: torch.Tensor, d: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    exact = rtn.dequantize_scaled(codes, d)  # float32 [V, H]: also the dense copy
    q8 = Q8BlockWeight(codes, d)
    quant.set_cpu_kernel("torch")  # the two-term int8 layout (what --quantization-kernel torch gives the head)
    two = quant.to_kernel(quant.QTensor("int8", codes, d, origin="Q8_0"), "cpu", exact=True)
    quant.set_cpu_kernel("auto")
    assert isinstance(two, quant.Int8Weight) and two.codes2 is not None
    pc_codes, pc_scale = rtn.quantize_int8(exact)  # per-row codes (what torch's int8 kernel can hold)
    sw_bf16 = pc_scale[:, 0].to(torch.bfloat16)
    wt, sw = int8_codes(exact)
    wt = wt.t().contiguous()
    return {
        "dense_f32": lambda x: F.linear(x, exact),
        "q8_native": lambda x: cpu_ops.q8_linear(x, q8.codes, q8.d),
        "int8_torch": lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), pc_codes, sw_bf16).float(),
        "int8_torch_2": two,
        "w8a8_int_mm": lambda x: w8a8_mm(x, wt, sw),
        "_exact": lambda x: F.linear(x, exact),
    }


def bench_head(path: str, rows: list[int], reps: int) -> None:
    codes, d = load_head(path)
    fns = head_variants(codes, d)
    g = torch.Generator().manual_seed(0)
    print(f"\n{os.path.basename(path)}: head {tuple(codes.shape)} Q8_0; x ~ N(0, 1) * 3")
    print("| rows | variant | ms (median) | rel. error vs exact |")
    print("|---:|---|---:|---:|")
    for m in rows:
        x = torch.randn(m, codes.shape[1], generator=g) * 3
        want = fns["_exact"](x)
        for name, fn in fns.items():
            if name.startswith("_"):
                continue
            t, y = _time(lambda fn=fn, x=x: fn(x), reps)
            rel = ((y - want).abs().max() / want.abs().max()).item()
            print(f"| {m} | {name} | {t * 1e3:.2f} | {rel:.1e} |", flush=True)
        del want


SETTINGS = {"top_k=50": {"top_k": 50}, "top_k=50 top_p=0.9": {"top_k": 50, "top_p": 0.9},
            "top_k=256 min_p=0.05": {"top_k": 256, "min_p": 0.05}, "top_p=0.9": {"top_p": 0.9},
            "top_k=1000": {"top_k": 1000}}


def _logits(m: int, vocab: int, shape: str, g: torch.Generator) -> torch.Tensor:
    """flat: N(0, 3^2) (no nucleus fits in 256 tokens); peaked: N(0, 2^2) plus 30 tokens raised by 9..15, most
    of the mass on a few dozen tokens, as a language model's next-token distribution usually is."""
    x = torch.randn(m, vocab, generator=g) * (3 if shape == "flat" else 2)
    if shape == "peaked":
        for r in range(m):
            x[r, torch.randperm(vocab, generator=g)[:30]] += torch.linspace(9, 15, 30)
    return x


def bench_sampling(vocab: int, rows: list[int], reps: int) -> None:
    from runtime.sampling import SamplingInfo, sample, sampler
    from runtime.sampling.params import SamplingParams

    g = torch.Generator().manual_seed(1)
    print(f"\nsample() over [rows, {vocab}] logits, temperature 0.8")
    print("| rows | logits | filters | before: full vocabulary, ms | after: candidates, ms |")
    print("|---:|---|---|---:|---:|")
    for m in rows:
        for shape in ("flat", "peaked"):
            logits = _logits(m, vocab, shape, g)
            for name, kw in SETTINGS.items():
                params = [SamplingParams(temperature=0.8, **kw)] * m
                info = SamplingInfo.build(params, [[] for _ in range(m)], [0] * m, vocab,
                                          [[] for _ in range(m)], default_seed=0)
                times = {}
                for label, cap in (("before", 0), ("after", sampler.CANDIDATE_MAX_K)):
                    keep, sampler.CANDIDATE_MAX_K = sampler.CANDIDATE_MAX_K, cap
                    times[label], _ = _time(lambda info=info, lg=logits: sample(lg, info).next_ids, reps)
                    sampler.CANDIDATE_MAX_K = keep
                print(f"| {m} | {shape} | {name} | {times['before'] * 1e3:.2f} | {times['after'] * 1e3:.2f} |",
                      flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF file(s), comma-separated (default: the gemma-model package's)")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--skip-head", action="store_true")
    ap.add_argument("--skip-sampling", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    print(describe())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = [int(r) for r in args.rows.split(",")]
    if not args.skip_head:
        if args.gguf is None:
            from runtime.models.registry import gemma3_model_path

            args.gguf = gemma3_model_path()
        for path in args.gguf.split(","):
            bench_head(path, rows, args.reps)
    if not args.skip_sampling:
        bench_sampling(262144, rows, args.reps)

if __name__ == "__main__":
    main()
