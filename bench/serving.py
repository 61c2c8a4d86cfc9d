"""How fast does `radixgen serve` answer under load? An online load generator in the style of SGLang's
bench_serving, over the native /generate API (streaming SSE).

Datasets: `random` (random token ids, input/output lengths drawn from [len * (1 - range_ratio), len]) and
`generated-shared-prefix` (groups of prompts sharing a long system prompt, then a distinct question).
Arrivals: Poisson at --request-rate (inf: all at once), at most --max-concurrency in flight.
Per request: TTFT = first chunk carrying tokens - send; ITL = gaps between token-carrying chunks;
TPOT = (E2E - TTFT) / (output tokens - 1); E2E = last chunk - send.

    python bench/serving.py --launch --concurrency-sweep 1,8,32 --num-prompts 64 --write-results
    python bench/serving.py --base-url http://127.0.0.1:30000 --dataset-name generated-shared-prefix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "serving.md")


@dataclass
class Req:
    input_ids: list[int]
    output_len: int


@dataclass
class Out:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


# ---------------------------------------------------------------- datasets

def _lens(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo = max(1, int(length * (1 - ratio)))
    return [rng.randint(lo, length) for _ in range(n)]


def random_dataset(args: argparse.Namespace, vocab: int) -> list[Req]:
    rng = random.Random(args.seed)
    ins = _lens(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    outs = _lens(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    return [Req([rng.randrange(256, vocab) for _ in range(i)], o) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_dataset(args: argparse.Namespace, vocab: int) -> list[Req]:
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.gsp_num_groups):
        system = [rng.randrange(256, vocab) for _ in range(args.gsp_system_prompt_len)]
        for _ in range(args.gsp_prompts_per_group):
            question = [rng.randrange(256, vocab) for _ in range(args.gsp_question_len)]
            reqs.append(Req(system + question, args.gsp_output_len))
    rng.shuffle(reqs)
    return reqs


# ---------------------------------------------------------------- client

async def send(client: httpx.AsyncClient, req: Req, ignore_eos: bool, stream: bool) -> Out:
    out = Out(prompt_len=len(req.input_ids))
    body = {"input_ids": req.input_ids, "stream": stream,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}}
    t0 = time.perf_counter()
    last = t0
    try:
        if not stream:
            r = await client.post("/generate", json=body)
            r.raise_for_status()
            out.e2e = out.ttft = time.perf_counter() - t0
            out.output_len = r.json()["meta_info"]["completion_tokens"]
            out.ok = True
            return out
        async with client.stream("POST", "/generate", json=body) as r:
            r.raise_for_status()
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                n = len(chunk["output_ids"])
                if n > seen:
                    now = time.perf_counter()
                    if seen == 0:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last, seen = now, n
                out.output_len = chunk["meta_info"]["completion_tokens"]
        out.e2e = last - t0
        out.ok = True
    except Exception as e:  # a failed request is counted, not fatal
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run(base_url: str, reqs: list[Req], rate: float, concurrency: int | None, ignore_eos: bool,
              stream: bool, seed: int) -> tuple[list[Out], float]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency or len(reqs))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        async def limited(r: Req) -> Out:
            async with sem:
                return await send(client, r, ignore_eos, stream)

        tasks = []
        start = time.perf_counter()
        for r in reqs:
            tasks.append(asyncio.ensure_future(limited(r)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        outs = await asyncio.gather(*tasks)
        return outs, time.perf_counter() - start


# ---------------------------------------------------------------- report

def _stats(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return 0.0, 0.0, 0.0
    s = sorted(xs)
    return statistics.fmean(s), statistics.median(s), s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def summarize(outs: list[Out], duration: float) -> dict[str, float]:
    ok = [o for o in outs if o.ok]
    out_tokens = sum(o.output_len for o in ok)
    tpots = [(o.e2e - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    res = {"completed": len(ok), "failed": len(outs) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration, "input_tok_s": sum(o.prompt_len for o in ok) / duration,
           "output_tok_s": out_tokens / duration, "concurrency": sum(o.e2e for o in ok) / duration}
    for name, xs in (("ttft", [o.ttft for o in ok]), ("tpot", tpots), ("itl", [x for o in ok for x in o.itl]),
                     ("e2e", [o.e2e for o in ok])):
        res[f"{name}_mean_ms"], res[f"{name}_median_ms"], res[f"{name}_p99_ms"] = (1000 * v for v in _stats(xs))
    return res


COLUMNS = [("max_concurrency", "conc"), ("num_prompts", "prompts"), ("completed", "ok"), ("request_throughput", "req/s"),
           ("output_tok_s", "out tok/s"), ("ttft_mean_ms", "TTFT mean"), ("ttft_median_ms", "TTFT med"),
           ("ttft_p99_ms", "TTFT p99"), ("tpot_mean_ms", "TPOT mean"), ("tpot_median_ms", "TPOT med"),
           ("tpot_p99_ms", "TPOT p99"), ("itl_mean_ms", "ITL mean"), ("itl_median_ms", "ITL med"),
           ("itl_p99_ms", "ITL p99"), ("e2e_mean_ms", "E2E mean"), ("e2e_median_ms", "E2E med"),
           ("e2e_p99_ms", "E2E p99")]


def table(rows: list[dict[str, float]]) -> str:
    head = "| " + " | ".join(t for _, t in COLUMNS) + " |"
    sep = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_fmt(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"
    return "inf" if v is None else str(v)


# ---------------------------------------------------------------- main

def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = args.port
    cmd = [sys.executable, "-m", "server", "serve", "--compile-mode", "sync", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *args.server_args.split()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("radixgen ready on"):
            return proc, f"http://127.0.0.1:{port}"
        sys.stderr.write(line)
    raise SystemExit(f"server exited with {proc.wait()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--launch", action="store_true", help="start `python -m server serve` for the run")
    p.add_argument("--port", type=int, default=30000, help="port for --launch")
    p.add_argument("--server-args", default="", help="extra flags for --launch, e.g. '--max-total-tokens 65536'")
    p.add_argument("--dataset-name", choices=["random", "generated-shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--concurrency-sweep", default=None, help="comma list: one run per max concurrency")
    p.add_argument("--num-prompts-sweep", default=None,
                   help="comma list parallel to --concurrency-sweep: the first N prompts for each run")
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before each run")
    p.add_argument("--vocab-size", type=int, default=None, help="default: from /get_model_info")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSON line per run")
    p.add_argument("--write-results", action="store_true", help=f"write the table to {RESULTS}")
    args = p.parse_args()

    proc = None
    base = args.base_url
    if args.launch:
        proc, base = launch(args)
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            info = c.get("/get_model_info").json()
        vocab = args.vocab_size or info.get("vocab_size") or 32000
        data = (random_dataset if args.dataset_name == "random" else shared_prefix_dataset)(args, vocab)
        sweep = [int(x) for x in args.concurrency_sweep.split(",")] if args.concurrency_sweep else [args.max_concurrency]
        counts = ([int(x) for x in args.num_prompts_sweep.split(",")] if args.num_prompts_sweep
                  else [args.num_prompts] * len(sweep))
        if len(counts) != len(sweep):
            raise SystemExit("--num-prompts-sweep needs one count per --concurrency-sweep entry")
        warm = [Req(r.input_ids[:16], 4) for r in data[:args.warmup_requests]]
        if warm:
            asyncio.run(run(base, warm, float("inf"), None, True, True, args.seed))
        rows = []
        for conc, count in zip(sweep, counts, strict=True):
            if args.flush_cache:
                with httpx.Client(base_url=base, timeout=60) as c:
                    c.post("/flush_cache")
            outs, duration = asyncio.run(run(base, data[:count], args.request_rate, conc, not args.disable_ignore_eos,
                                             not args.disable_stream, args.seed))
            row = {"max_concurrency": conc, "num_prompts": count, **summarize(outs, duration)}
            rows.append(row)
            errors = sorted({o.error for o in outs if not o.ok})
            print(f"concurrency {conc}: {row['completed']} ok, {row['failed']} failed {errors[:3]}", flush=True)
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json.dumps({**vars(args), **row}) + "\n")
        out = table(rows)
        print(out)
        if args.write_results:
            _write(args, info, out)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def _write(args: argparse.Namespace, info: dict, out: str) -> None:
    ds = (f"random, input {args.random_input_len}, output {args.random_output_len}, range ratio "
          f"{args.random_range_ratio}" if args.dataset_name == "random" else
          f"generated-shared-prefix, {args.gsp_num_groups} groups x {args.gsp_prompts_per_group}, system "
          f"{args.gsp_system_prompt_len}, question {args.gsp_question_len}, output {args.gsp_output_len}")
    section = (f"\n## {args.dataset_name}, request rate {args.request_rate}\n\n"
               f"Model `{os.path.basename(info.get('model_path', '?'))}`; dataset {ds}; "
               f"ignore_eos {not args.disable_ignore_eos}; server args `{args.server_args or '(defaults)'}`; "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Latencies in ms.\n\n{out}\n")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    if not os.path.exists(RESULTS):
        with open(RESULTS, "w") as f:
            f.write("# Serving benchmark (bench/serving.py)\n")
    with open(RESULTS, "a") as f:
        f.write(section)


if __name__ == "__main__":
    main()
