"""Scale-out on one machine: two workers behind sglang-router (`radixgen serve --dp-size 2`) vs one server with
every core, on a workload that rewards prefix-aware routing.

Workload: 8 documents (~DOC_TOKENS tokens each) x 8 questions; a request is document + question, streamed
through the native /generate, greedy with ignore_eos (the same tokens everywhere), CONCURRENCY in flight,
sent question-major (every document's first question, then every second one, ...). Configurations, each a
fresh server on 127.0.0.1: `single` (one server, --num-threads = cores), `dp2-cache_aware` and
`dp2-round_robin` (--dp-size 2: two workers with half the threads each). Rounds alternate the configurations;
the report gives each one's medians over rounds: output throughput, TTFT p50, and the cache hit rate
(sum of cached_tokens / sum of prompt_tokens from each answer's meta_info).

    flock /tmp/radixgen-bench.lock python bench/scaleout.py [--rounds 2] [--port 31620]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from machine import describe  # noqa: E402  (bench/ is the script directory)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPICS = ["rivers", "glaciers", "volcanoes", "deserts", "forests", "oceans", "mountains", "islands"]
QUESTIONS = ["What is the main subject?", "Which region is mentioned first?", "How many events were recorded?",
             "Summarize the notes in one sentence.", "Which season appears most?", "Name one observer finding.",
             "What is unusual here?", "Give a title for these notes."]
CONFIGS = {"single": [], "dp2-cache_aware": ["--dp-size", "2"],
           "dp2-round_robin": ["--dp-size", "2", "--router-policy", "round_robin"]}


def document(d: int, words: int) -> str:
    topic, parts, i = TOPICS[d], [], 0
    while sum(len(p.split()) for p in parts) < words:
        parts.append(f"Note {i} on the {topic} of district {d}: observers counted {(i * 7 + d) % 23} events "
                     f"near site {i % 11} during season {(i + d) % 4}.")
        i += 1
    return " ".join(parts)


def workload(words: int) -> list[str]:
    docs = [document(d, words) for d in range(8)]
    return [f"{docs[d]}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS for d in range(8)]


def start(extra: list[str], port: int, threads: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "server", "serve", "--compile-mode", "sync", "--host", "127.0.0.1", "--port", str(port), "--num-threads",
            str(threads), "--disable-compile", "--log-level", "warning", *extra]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("radixgen ready on"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 600
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server {extra} did not start")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one(url: str, prompt: str, max_new: int) -> dict:
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, last = None, None
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/generate", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if ttft is None and ev.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = ev
    assert last is not None
    meta = last["meta_info"]
    return {"ttft": ttft, "prompt": meta["prompt_tokens"], "cached": meta["cached_tokens"],
            "out": meta["completion_tokens"]}


def run(url: str, prompts: list[str], max_new: int, concurrency: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda p: one(url, p, max_new), prompts))
    wall = time.perf_counter() - t0
    return {"throughput": sum(r["out"] for r in res) / wall, "ttft_p50": statistics.median(r["ttft"] for r in res),
            "hit_rate": sum(r["cached"] for r in res) / sum(r["prompt"] for r in res), "wall": wall,
            "prompt_tokens": statistics.mean(r["prompt"] for r in res)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=31620)
    ap.add_argument("--doc-words", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scaleout.md"))
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    prompts = workload(args.doc_words)
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for rnd in range(args.rounds):
        order = list(CONFIGS) if rnd % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            proc = start(CONFIGS[name], args.port, cores)
            try:
                r = run(f"http://127.0.0.1:{args.port}", prompts, args.output_len, args.concurrency)
            finally:
                stop(proc)
            rows[name].append(r)
            print(f"round {rnd} {name}: {json.dumps({k: round(v, 3) for k, v in r.items()})}", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in rows.items()}
    base = med["single"]["throughput"]
    lines = ["| configuration | output tok/s | vs single | TTFT p50 (s) | cache hit rate |", "| --- | --- | --- | --- | --- |"]
    for n, m in med.items():
        lines.append(f"| {n} | {m['throughput']:.1f} | {m['throughput'] / base:.2f}x | {m['ttft_p50']:.2f} | "
                     f"{m['hit_rate']:.2f} |")
    table = "\n".join(lines)
    print(table)
    with open(args.out, "w") as f:
        f.write(f"""# Scale-out on one machine: `--dp-size 2` behind sglang-router vs one server

`python bench/scaleout.py --rounds {args.rounds}` ({describe()},
SmolLM2-135M-Instruct default dtype/quantization, `--disable-compile` everywhere, {len(prompts)} requests:
8 documents x 8 questions, ~{med['single']['prompt_tokens']:.0f} prompt tokens each, {args.output_len} output
tokens, {args.concurrency} in flight, question-major order). Medians of {args.rounds} alternating rounds; each
configuration a fresh server. `single`: one server with --num-threads {cores}; `dp2-*`: `--dp-size 2`, two
workers with {max(1, cores // 2)} thread(s) each behind sglang-router. The machine was shared with other
sessions' work during the run, so absolute figures are noisy; compare rows of this one run.

{table}
""")


if __name__ == "__main__":
    main()
