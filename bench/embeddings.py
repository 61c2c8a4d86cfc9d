"""Embedding throughput: radixgen's /v1/embeddings (embedding mode, a real server on 127.0.0.1) against
sentence-transformers' `encode` in this process, on the same all-MiniLM-L6-v2 weights, float32, CPU, with the
same torch thread count. Writes bench/results/embeddings.md.

Workload: the 200 sentences of the embedding tests (repository prose, 3 to 250 tokens; median about 56).
- batch 1: one sentence per call, sequentially (radixgen: one HTTP request per sentence; sentence-transformers:
  `encode([s])`), over the first `--b1` sentences;
- batch 64: 64 sentences per call (radixgen: one request with 64 inputs; sentence-transformers:
  `encode(batch, batch_size=64)`), over all 200 sentences cut into batches of 64 (the last one shorter).
radixgen's answers are base64 (what the `openai` client asks for by default). Each round runs every
(system, batch) once, the order alternating between rounds; the figures are medians over rounds. The 1-minute
load average is recorded before each round (the machine is shared).

    python bench/embeddings.py [--rounds 3] [--threads 2] [--b1 64] [--port 31900]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runtime.models.registry import embedding_model_path  # noqa: E402
from tests.runtime.models.sentences import sentences  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "embeddings.md")


def start_server(model: str, threads: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "serve", "--model-path", model, "--num-threads", str(threads),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.startswith("radixgen ready on"):
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the radixgen server did not start")


def radixgen_run(client: httpx.Client, batches: list[list[str]]) -> float:
    """Sentences per second over `batches`, one request each."""
    n = sum(len(b) for b in batches)
    t = time.perf_counter()
    for b in batches:
        r = client.post("/v1/embeddings", json={"input": b, "encoding_format": "base64"})
        r.raise_for_status()
        assert len(r.json()["data"]) == len(b)
    return n / (time.perf_counter() - t)


def st_run(model, batches: list[list[str]]) -> float:
    n = sum(len(b) for b in batches)
    t = time.perf_counter()
    for b in batches:
        out = model.encode(b, batch_size=64, convert_to_numpy=True)
        assert out.shape[0] == len(b)
    return n / (time.perf_counter() - t)


def load1() -> float:
    return os.getloadavg()[0]


def cpu_facts() -> tuple[str, str]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    facts = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return facts.get("Model name", "?").strip(), facts.get("Flags", "?").strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--b1", type=int, default=64, help="sentences measured one at a time")
    ap.add_argument("--port", type=int, default=31900)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer
    from sentence_transformers import __version__ as st_version

    torch.set_num_threads(args.threads)
    model_dir = embedding_model_path()
    sents = sentences()
    workloads = {"batch 1": [[s] for s in sents[: args.b1]],
                 "batch 64": [sents[i : i + 64] for i in range(0, len(sents), 64)]}
    st = SentenceTransformer(model_dir, device="cpu")
    proc = start_server(model_dir, args.threads, args.port)
    results: dict[tuple[str, str], list[float]] = {}
    loads = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=300) as client:
            for batches in workloads.values():  # warm-up, untimed
                radixgen_run(client, batches[:2])
                st_run(st, batches[:2])
            systems = {"radixgen": lambda b: radixgen_run(client, b), "sentence-transformers": lambda b: st_run(st, b)}
            for r in range(args.rounds):
                loads.append(load1())
                order = list(systems) if r % 2 == 0 else list(reversed(systems))
                for wl, batches in workloads.items():
                    for name in order:
                        v = systems[name](batches)
                        results.setdefault((name, wl), []).append(v)
                        print(f"round {r + 1} {wl:9s} {name:22s} {v:8.1f} sentences/s (load {loads[-1]:.2f})",
                              flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    report = render(args, results, loads, st_version)
    print(report)
    if not args.no_write:
        with open(RESULTS, "w", encoding="utf-8") as f:
            f.write(report)


def render(args, results, loads, st_version: str) -> str:
    cpu, flags = cpu_facts()
    med = {k: statistics.median(v) for k, v in results.items()}
    lines = ["# Embeddings: radixgen vs sentence-transformers (all-MiniLM-L6-v2, float32, CPU)", "",
             f"- CPU: {cpu}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, "
             f"sentence-transformers {st_version}; {args.threads} torch threads for both",
             f"- flags: {flags}",
             f"- command: `python bench/embeddings.py --rounds {args.rounds} --threads {args.threads} --b1 {args.b1}`",
             f"- 1-minute load average before each round: {', '.join(f'{x:.2f}' for x in loads)} "
             "(a machine shared with other work: figures are medians of alternating rounds)",
             *([f"- **the machine was busy**: load {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs "
                "(other work running), so absolute figures are far below a quiet machine's and the ratios are "
                "noisy; read the ratios of the alternating rounds only"] if max(loads) > (os.cpu_count() or 1) else []),
             "- radixgen: the full server path (HTTP, JSON, tokenizer manager, ZMQ, scheduler, base64 answers); "
             "sentence-transformers: `encode` in the benchmark process", "",
             "| workload | radixgen sentences/s | sentence-transformers sentences/s | ratio | rounds (radixgen / st) |",
             "|---|---:|---:|---:|---|"]
    for wl in ("batch 1", "batch 64"):
        a, b = med[("radixgen", wl)], med[("sentence-transformers", wl)]
        raw = " / ".join(", ".join(f"{x:.1f}" for x in results[(n, wl)]) for n in ("radixgen", "sentence-transformers"))
        lines.append(f"| {wl} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {raw} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
