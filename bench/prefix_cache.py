"""One question: how much does the radix prefix cache buy on workloads that share prefixes?

Runs two workloads through `runtime.Engine`, with the cache on and off in the same process, back to back:
- RAG: one long document (~1,500 tokens) and N questions about it, all submitted at once.
- multi-turn chat: C conversations x T turns, each turn resending the whole history plus a new question
  (conversations run concurrently, turns within one conversation in order).
Every request streams, so TTFT is measured per request (submit -> first chunk). Greedy with ignore_eos, so
both modes produce the same number of tokens. Reports throughput (output tok/s), mean TTFT, and the cache
hit rate (sum of cached_tokens / sum of prompt_tokens), and writes bench/results/prefix_cache.md.

    python bench/prefix_cache.py [--questions 64] [--doc-tokens 1500] [--output-len 64]
                                 [--convs 16] [--turns 4] [--chat-output-len 32] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine import describe  # noqa: E402  (bench/ is the script directory)

from runtime import Engine  # noqa: E402
from runtime.config import make_config, resolve  # noqa: E402

TOPICS = ["rivers", "glaciers", "volcanoes", "deserts", "forests", "oceans", "mountains", "islands",
          "caves", "lakes", "canyons", "reefs", "valleys", "plains", "swamps", "tundra"]


def make_document(tok, target_tokens: int) -> str:
    parts, i = [], 0
    while True:
        t = TOPICS[i % len(TOPICS)]
        parts.append(f"Section {i}: Field notes on {t}. Observers recorded {i * 7 % 23} unusual events near the "
                     f"{t} of region {i % 11}, most of them during the season numbered {i % 4}.")
        text = " ".join(parts)
        if len(tok.encode(text)) >= target_tokens:
            return text
        i += 1


def stream_one(engine, prompt: str, max_new: int) -> dict:
    """Submit one streaming request; TTFT, end time, and the final meta_info."""
    t0 = time.perf_counter()
    ttft, last = None, None
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    for chunk in engine.generate(prompt, params, stream=True):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        last = chunk
    meta = last["meta_info"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": last["text"],
            "prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
            "cached_tokens": meta["cached_tokens"]}


def summarize(results: list[dict], wall: float) -> dict:
    out = sum(r["completion_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    return {"requests": len(results), "wall_s": wall, "output_tok_s": out / wall,
            "mean_ttft_s": statistics.mean(r["ttft"] for r in results),
            "hit_rate": sum(r["cached_tokens"] for r in results) / max(prompt, 1),
            "prompt_tokens": prompt, "output_tokens": out}


def run_rag(engine, doc: str, n: int, max_new: int) -> dict:
    prompts = [f"{doc}\n\nQuestion {i}: what happened near the {TOPICS[i % len(TOPICS)]} in section {i}?\n"
               f"Answer:" for i in range(n)]
    t = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: stream_one(engine, p, max_new), prompts))
    return summarize(results, time.perf_counter() - t)


def run_chat(engine, convs: int, turns: int, max_new: int) -> dict:
    system = ("<|im_start|>system\nYou are a field guide. Answer every question about landscapes in two or "
              "three sentences, with one concrete example each time.<|im_end|>\n")
    results: list[dict] = []
    lock = threading.Lock()

    def conversation(c: int) -> None:
        history = system
        for t in range(turns):
            history += (f"<|im_start|>user\nQuestion {t} of conversation {c}: tell me about "
                        f"{TOPICS[(c + t) % len(TOPICS)]}.<|im_end|>\n<|im_start|>assistant\n")
            r = stream_one(engine, history, max_new)
            history += r["text"] + "<|im_end|>\n"
            with lock:
                results.append(r)

    t = time.perf_counter()
    with ThreadPoolExecutor(convs) as pool:
        list(pool.map(conversation, range(convs)))
    return summarize(results, time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--chat-output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the scheduler process")
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a small smoke run (8 questions, 400-token doc, 2x2 chat)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "prefix_cache.md"))
    args = ap.parse_args()
    if args.quick:
        args.questions, args.doc_tokens, args.output_len = 8, 400, 16
        args.convs, args.turns, args.chat_output_len = 2, 2, 16
    extra = {"num_threads": args.threads}
    if args.max_total_tokens:
        extra["max_total_tokens"] = args.max_total_tokens

    cfg = resolve(make_config(**extra))  # what the engines below run: dtype auto resolved for this machine
    rows: dict[tuple[str, str], dict] = {}
    states: dict[str, dict] = {}
    for mode in ("on", "off"):
        with Engine(disable_radix_cache=(mode == "off"), **extra) as engine:
            doc = make_document(engine.tokenizer, args.doc_tokens)
            stream_one(engine, "Warm up.", 2)  # first-call costs out of the measurement
            engine.flush_cache()
            rows[("rag", mode)] = run_rag(engine, doc, args.questions, args.output_len)
            engine.flush_cache()
            rows[("chat", mode)] = run_chat(engine, args.convs, args.turns, args.chat_output_len)
            states[mode] = engine.get_server_info()["internal_states"][0]
        for wl in ("rag", "chat"):
            r = rows[(wl, mode)]
            print(f"{wl:5s} cache {mode:3s}: {r['output_tok_s']:8.1f} out tok/s  TTFT {r['mean_ttft_s']:7.2f} s  "
                  f"hit {r['hit_rate']:.1%}  wall {r['wall_s']:.1f} s", flush=True)

    lines = [
        "# Prefix cache: radix cache on vs off",
        "",
        f"`python bench/prefix_cache.py {' '.join(sys.argv[1:])}` on {describe()} "
        f"({os.cpu_count()} cores, {args.threads} torch threads), SmolLM2-135M-Instruct {cfg.model.dtype} "
        f"(`--quantization {cfg.model.quantization}`), through "
        "`runtime.Engine` (streaming, greedy, ignore_eos). Both modes in one process, back to back.",
        "",
        f"- RAG: one {args.doc_tokens}-token document, {args.questions} questions at once, "
        f"{args.output_len} output tokens each.",
        f"- chat: {args.convs} conversations x {args.turns} turns, {args.chat_output_len} output tokens per turn.",
        "",
        "| workload | cache | requests | prompt tok | output tok | wall s | output tok/s | mean TTFT s | hit rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (wl, mode), r in rows.items():
        lines.append(f"| {wl} | {mode} | {r['requests']} | {r['prompt_tokens']} | {r['output_tokens']} | "
                     f"{r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['mean_ttft_s']:.2f} | {r['hit_rate']:.1%} |")
    lines += ["", "| workload | throughput ratio (on/off) | mean TTFT ratio (off/on) |", "|---|---|---|"]
    for wl in ("rag", "chat"):
        on, off = rows[(wl, "on")], rows[(wl, "off")]
        lines.append(f"| {wl} | {on['output_tok_s'] / off['output_tok_s']:.2f}x | "
                     f"{off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x |")
    lines += ["", f"Scheduler state after the cache-on run: `{states['on']}`", ""]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
