"""Where does a big step's time go? The scheduler on the real SmolLM2 runner, in process, as the server runs it.

    .venv/bin/python bench/step_profile.py [--quantization auto|w8a8_int8] [--compile-mode off|sync]
                                           [--scenarios prefill1k c32] [--decode-steps 8] [--ops 25]

Scenarios (bench/peers/workloads.py's shapes): `prefill1k`, one 1,000-token prompt (its whole prefill step);
`c32`, 32 distinct 84-token prompts arriving together (the admission steps), then `--decode-steps` steps of
32 decode rows; `mixed`, 31 requests decoding while one 1,000-token prompt is admitted (one mixed step);
`rag`, 16 prompts arriving together, each a shared 2,150-token document and 24 tokens of its own (the first
step computes the document's first chunk, the second the rest of it and every question off the cached
document), then `--decode-steps` steps of 16 decode rows over the shared prefix (the attention backend's
shared-prefix length of the last decode step is printed).
Each step is split by perf_counter wrappers around the forward's calls (every linear by class, attention,
each row op, the embedding), the runner's metadata and upload, the scheduler's planning (`begin_step` and
`Batch.forward_batch`) and the sampling and output (`end_step`); "forward glue" is what the model's forward
spends outside the wrapped calls (Python, views, residual adds, the logits rows' gather). CPU ops are
synchronous, so a wrapper's wall time is the call's time. `--ops N` adds the top N ATen ops of one profiled
repeat (torch.profiler, self CPU time). The torch thread count is printed: the server's scheduler sets 2.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from machine import describe  # noqa: E402

import kernels.quant as quant  # noqa: E402
from runtime.config import make_config  # noqa: E402
from runtime.executor import model_runner as mr  # noqa: E402
from runtime.executor.model_runner import create_model_runner  # noqa: E402
from runtime.messages import TokenizedGenerateReq  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402
from runtime.scheduler import Scheduler  # noqa: E402
from runtime.scheduler import scheduler as sched_mod  # noqa: E402

VOCAB = 49152
RAG_DOC, RAG_QUESTION, RAG_QUESTIONS = 2150, 24, 16  # the peers' `rag` workload at --rag-questions 16
TIMES: dict[str, float] = collections.defaultdict(float)


def timed(name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name(*a) if callable(name) else name] += time.perf_counter() - t
    return wrapper


def instrument(runner: Any) -> None:
    """Wrap the forward's calls; names are keys of TIMES."""
    model = runner.model
    names = {id(model.lm_head): "linear lm_head"}
    for lw in model.layers:
        for n in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            names[id(getattr(lw, n))] = f"linear {n[2:]}"
    lin = quant.linear
    quant.linear = timed(lambda x, w, b=None: names.get(id(w), "linear ?"), lin)  # llama calls quant.linear
    quant.embedding = timed("embedding", quant.embedding)
    ew = model.ew
    model.ew = type(ew)(timed("rmsnorm", ew.rmsnorm), timed("rope", ew.apply_rope), timed("silu_mul", ew.silu_mul))
    runner.attn.forward = timed("attention", runner.attn.forward)
    runner.model.forward = timed("forward (model)", runner.model.forward)
    runner.forward = timed("runner.forward", runner.forward)
    mr.upload = timed("upload", mr.upload)
    sched_cls = sched_mod.Scheduler
    for m in ("begin_step", "end_step"):
        setattr(sched_cls, m, timed(f"scheduler.{m}", getattr(sched_cls, m)))
    batch_cls = sched_mod.Batch
    batch_cls.forward_batch = timed("Batch.forward_batch", batch_cls.forward_batch)


def breakdown(total: float) -> list[tuple[str, float]]:
    t = dict(TIMES)
    inner = sum(v for k, v in t.items() if k.startswith("linear") or k in
                ("attention", "rmsnorm", "rope", "silu_mul", "embedding"))
    rows = sorted(((k, v) for k, v in t.items() if k.startswith("linear")), key=lambda kv: -kv[1])
    if "forward (model)" not in t and "runner.forward" in t:  # compiled decode: one graph replay per step
        rows.append(("attention", t.get("attention", 0.0)))
        rows.append(("compiled graph: the rest + metadata", t["runner.forward"] - t.get("attention", 0.0)))
    else:
        rows += [(k, t.get(k, 0.0)) for k in ("attention", "rmsnorm", "rope", "silu_mul", "embedding")]
        rows.append(("forward glue", t.get("forward (model)", 0.0) - inner))
        rows.append(("runner metadata+upload", t.get("runner.forward", 0.0) - t.get("forward (model)", 0.0)))
    rows.append(("scheduler plan (begin_step)", t.get("scheduler.begin_step", 0.0)))
    rows.append(("Batch.forward_batch", t.get("Batch.forward_batch", 0.0)))
    rows.append(("sample+output (end_step)", t.get("scheduler.end_step", 0.0)))
    rows.append(("step total", total))
    return rows


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256, VOCAB) for _ in range(n)]


def run(sched: Scheduler, reqs: list[list[int]], max_new: int, steps: int | None, rid: str,
        admit: bool = True) -> tuple[float, int]:
    """Add `reqs`, then step until none waits (admit) and `steps` more; (seconds, steps)."""
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    for i, r in enumerate(reqs):
        sched.handle(TokenizedGenerateReq(rid=f"{rid}{i}", input_ids=r, sampling_params=sp))
    t, n = time.perf_counter(), 0
    while admit and (sched.waiting or sched.chunked is not None):
        sched.step()
        n += 1
    for _ in range(steps or 0):
        sched.step()
        n += 1
    return time.perf_counter() - t, n


def scenario(sched: Scheduler, name: str, seed: int, decode_steps: int,
             ops: int = 0) -> dict[str, tuple[float, int, dict]]:
    """Run one scenario; per timed phase (seconds, steps, TIMES of that phase alone). ops > 0: profile each
    phase with torch.profiler instead and print its top `ops` ATen ops by self CPU time."""
    rng = random.Random(seed)
    out = {}

    def phase(key: str, reqs: list[list[int]], max_new: int, steps: int, admit: bool = True) -> None:
        TIMES.clear()
        if ops:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run(sched, reqs, max_new, steps, f"{key[:1]}x{seed}", admit)
            print(f"\n## {key}: top {ops} ops (torch.profiler)\n" + prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=ops, max_name_column_width=40))
            return
        sec, n = run(sched, reqs, max_new, steps, f"{key[:1]}x{seed}", admit)
        out[key] = (sec, n, dict(TIMES))

    if name == "prefill1k":
        phase("prefill1k step", [ids(rng, 1000)], 1, 0)
    elif name == "c32":
        phase("c32 admission", [ids(rng, 84) for _ in range(32)], 4 + decode_steps, 0)
        phase("c32 decode (32 rows)", [], 0, decode_steps)
    elif name == "rag":
        doc = ids(rng, RAG_DOC)
        qs = [doc + ids(rng, RAG_QUESTION) for _ in range(RAG_QUESTIONS)]
        phase("rag step 1 (document chunk)", qs, 32, 1, admit=False)
        phase("rag step 2 (rest + 15 questions)", [], 0, 1, admit=False)
        assert not sched.waiting and sched.chunked is None, "rag: admission took more than 2 steps"
        phase(f"rag decode ({RAG_QUESTIONS} rows)", [], 0, decode_steps, admit=False)
        dec = getattr(sched.runner.attn, "_dec", None)
        print(f"# rag decode: shared prefix of the last decode step {getattr(dec, 'shared_len', '?')} slots",
              flush=True)
    elif name == "mixed":
        run(sched, [ids(rng, 84) for _ in range(31)], 64, 1, f"m{seed}")
        phase("mixed step (31 decode + 1k prefill)", [ids(rng, 1000)], 1, 0)
    while sched.has_work():
        sched.step()
    assert sched.flush_cache().success
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--compile-mode", default="off")
    ap.add_argument("--scenarios", nargs="+", default=["prefill1k", "c32", "mixed"])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per scenario (median shown)")
    ap.add_argument("--ops", type=int, default=0)
    ap.add_argument("--extra", nargs="*", default=[], help="more config as key=value (ints parsed)")
    ap.add_argument("--isa", default="auto", help="the kernels/cpu variant every native op runs (avx512, avx2, "
                    "portable); with ONEDNN_MAX_CPU_ISA=AVX2 and --extra dtype=float32, what an AVX2-only CPU runs")
    args = ap.parse_args()
    from kernels.cpu import ops

    variant = ops.cpu_isa(args.isa)  # before the model loads: the int8 linears pick their kernel by the variant
    extra = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in (e.split("=", 1) for e in args.extra)}
    cfg = make_config(**{"dtype": "auto", "num_threads": 2, "quantization": args.quantization,
                         "compile_mode": args.compile_mode, "max_total_tokens": 65536, **extra})
    t = time.perf_counter()
    runner = create_model_runner(cfg, progress=False)
    if runner.compile is not None:
        runner.compile.wait() if hasattr(runner.compile, "wait") else None
    print(f"# {describe()}; torch threads {torch.get_num_threads()}; kernels/cpu variant {variant}; "
          f"oneDNN {os.environ.get('ONEDNN_MAX_CPU_ISA', 'unrestricted')}; quantization {args.quantization}, "
          f"compile {args.compile_mode}, dtype {runner.dtype}, kv {runner.kv_dtype}; "
          f"start-up {time.perf_counter() - t:.1f} s", flush=True)
    instrument(runner)
    sched = Scheduler(runner, runner.allocator, runner.req_to_token, cfg, runner.eos_token_ids)
    for s in args.scenarios:
        scenario(sched, s, 0, args.decode_steps)  # warm-up
        results: dict[str, list[tuple[float, int, dict[str, float]]]] = collections.defaultdict(list)
        for r in range(args.repeats):
            for k, v in scenario(sched, s, r + 1, args.decode_steps).items():
                results[k].append(v)
        for k, rs in results.items():
            rs.sort(key=lambda x: x[0])
            sec, n, times = rs[len(rs) // 2]
            TIMES.clear()
            TIMES.update(times)
            print(f"\n## {k}: {sec * 1e3:.1f} ms over {n} step(s) (median of {len(rs)}; all "
                  f"{', '.join(f'{x[0] * 1e3:.0f}' for x in rs)} ms)")
            for name, v in breakdown(sec):
                print(f"  {name:32s} {v * 1e3:9.1f} ms {100 * v / sec:5.1f} %")
        if args.ops:
            scenario(sched, s, 99, args.decode_steps, args.ops)


if __name__ == "__main__":
    main()
