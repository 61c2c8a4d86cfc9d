"""Speculative decoding (n-gram) on vs off: per-request decode tokens/s on three workloads, side by side.

One `runtime.Engine` with `--speculative-algorithm ngram`; the "off" requests opt out per request
(`disable_speculation`), so both modes share the process, the weights, the compiled decode graphs and the
cache, and alternate round by round (on/off, then off/on, ...). Greedy. Decode rate of one request =
(completion_tokens - 1) / (time of the last chunk - time of the first chunk), from a streaming request, so
prefill is excluded. Workloads:
- rag:  a ~700-token document of notes; the question asks to quote two paragraphs word for word.
- code: a 60-line Python function; the request asks for it back with one name changed.
- chat: free chat questions (nothing to copy: the "no worse than 0.95x" case).
Reports per workload the median decode tok/s of each mode, the ratio, mean accepted length
(meta_info spec_accept_length) and whether the greedy texts were identical, and writes
bench/results/speculative.md. `--concurrency N` keeps N streaming requests of a workload in flight at once
(its prompts cycled to at least N requests, so copies of one prompt decode side by side); the rate stays per
request. `--min-accept` / `--pause-steps` set the adaptive pause (--speculative-min-accept / -pause-steps;
--min-accept 0: always propose).

    python bench/speculative.py [--rounds 3] [--max-new 160] [--draft-tokens 4] [--dtype auto]
                                [--quantization auto] [--concurrency 1] [--min-accept 1.0] [--pause-steps 8]
                                [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine import describe  # noqa: E402  (bench/ is the script directory)

from runtime import Engine  # noqa: E402
from runtime.config import SpeculativeConfig  # noqa: E402

NOTES = [
    "The northern station records wind speed every ten minutes and sends the averages to the main office at noon.",
    "Visitors must sign the log book at the gate, wear a helmet on the lower level, and leave before six.",
    "The pump in building C was replaced in March after the bearings failed during the spring flood.",
    "Water samples from the east well showed iron levels twice the limit, so that well is closed until June.",
    "The road to the upper camp is gravel for the last four miles and is closed to trucks after heavy rain.",
    "Solar panels on the roof produce about forty kilowatt hours on a clear day and half that in winter.",
    "The backup generator runs a self test every Sunday at three in the morning for fifteen minutes.",
    "Staff meetings are held on the first Monday of each month in the library on the second floor.",
]


def rag_prompt() -> str:
    doc = "\n\n".join(f"Note {i + 1}. {NOTES[i % len(NOTES)]} {NOTES[(i * 3 + 1) % len(NOTES)]}" for i in range(12))
    return (f"Here are the site notes:\n\n{doc}\n\nQuote Note 4 and Note 9 word for word, "
            "each on its own line, with no other text.")


def code_prompt() -> str:
    lines = ["def summarize_orders(orders, tax_rate, discount_codes):",
             '    """Totals per customer, with tax and discounts applied."""',
             "    totals = {}", "    counts = {}"]
    i = 0
    while len(lines) < 56:
        lines += ["    for order in orders:" if i == 0 else f"    for item in orders[{i}:]:",
                  f"        customer = order['customer'] if {i} == 0 else item['customer']",
                  f"        amount = order['amount'] * (1 + tax_rate) if {i} == 0 else item['amount'] * {i + 1}",
                  "        if customer in discount_codes:",
                  "            amount = amount * 0.9",
                  "        totals[customer] = totals.get(customer, 0) + amount",
                  "        counts[customer] = counts.get(customer, 0) + 1"]
        i += 1
    lines += ["    result = []", "    for customer in sorted(totals):",
              "        result.append((customer, round(totals[customer], 2), counts[customer]))", "    return result"]
    code = "\n".join(lines[:60])
    return (f"Here is a Python function:\n\n```python\n{code}\n```\n\nRewrite it with the variable `totals` renamed to "
            "`sums`. Output the whole function, nothing else.")


CHAT = ["Tell me a short story about a dragon who learns to bake bread.",
        "What are three good habits for staying healthy? Explain each briefly.",
        "Describe a walk through a forest in autumn."]


def decode_rate(engine, prompt: str, max_new: int, spec: bool) -> dict:
    msgs = [{"role": "user", "content": prompt}]
    ids = engine.tokenizer.encode_chat(msgs)
    params = {"max_new_tokens": max_new, "temperature": 0.0, "disable_speculation": not spec}
    first = last = None
    out = None
    for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
        now = time.perf_counter()
        if first is None and chunk["output_ids"]:
            first = now
        last, out = now, chunk
    meta = out["meta_info"]
    n = meta["completion_tokens"]
    return {"rate": (n - 1) / (last - first) if n > 1 and last > first else 0.0, "tokens": n,
            "text": out["text"], "accept": meta.get("spec_accept_length", 1.0)}


def run_wave(engine, prompts: list[str], max_new: int, spec: bool, concurrency: int) -> list[dict]:
    """The workload's prompts (cycled to at least `concurrency` requests), `concurrency` in flight at a time;
    results in request order."""
    jobs = [prompts[i % len(prompts)] for i in range(max(len(prompts), concurrency))]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: decode_rate(engine, p, max_new, spec), jobs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=1, help="requests of a workload in flight at once")
    ap.add_argument("--min-accept", type=float, default=SpeculativeConfig.speculative_min_accept,
                    help="--speculative-min-accept (0: never pause)")
    ap.add_argument("--pause-steps", type=int, default=SpeculativeConfig.speculative_pause_steps,
                    help="--speculative-pause-steps")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "speculative.md"))
    args = ap.parse_args()
    kw = {"num_threads": args.threads} if args.threads else {}
    engine = Engine(max_total_tokens=8192, dtype=args.dtype, quantization=args.quantization, speculative_algorithm="ngram",
                    speculative_num_draft_tokens=args.draft_tokens, speculative_min_accept=args.min_accept,
                    speculative_pause_steps=args.pause_steps, compile_max_bs=max(1, args.concurrency), **kw)
    workloads = {"rag": [rag_prompt()], "code": [code_prompt()], "chat": CHAT}
    res: dict[tuple[str, bool], list[dict]] = {}
    try:
        for prompts in workloads.values():  # warm-up: caches the prompts, compiles nothing new later
            for p in prompts:
                decode_rate(engine, p, 8, True)
                decode_rate(engine, p, 8, False)
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for name, prompts in workloads.items():
                for spec in order:
                    for x in run_wave(engine, prompts, args.max_new, spec, args.concurrency):
                        res.setdefault((name, spec), []).append(x)
                        print(f"round {r} {name:5s} spec={spec!s:5s} {x['tokens']:4d} tok {x['rate']:7.2f} tok/s "
                              f"accept {x['accept']:.2f}", flush=True)
        state = engine.get_server_info()["internal_states"][0]
    finally:
        engine.shutdown()
    rows = []
    for name in workloads:
        on, off = res[(name, True)], res[(name, False)]
        med_on = statistics.median(x["rate"] for x in on)
        med_off = statistics.median(x["rate"] for x in off)
        same = all(a["text"] == b["text"] for a, b in zip(on, off, strict=True))
        acc = statistics.mean(x["accept"] for x in on)
        rows.append(f"| {name} | {len(on)} | {statistics.mean(x['tokens'] for x in on):.0f} | {med_off:.1f} | "
                    f"{med_on:.1f} | {med_on / med_off:.2f}x | {acc:.2f} | {'yes' if same else 'NO'} |")
    cmd = "flock /tmp/radixgen-bench.lock nice -n 0 python bench/speculative.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "# Speculative decoding (n-gram / prompt lookup): on vs off, "
        + ("single stream" if args.concurrency == 1 else f"{args.concurrency} streams"),
        "",
        f"`{cmd.strip()}` on {describe()}, SmolLM2-135M-Instruct "
        f"(dtype {args.dtype}, quantization {args.quantization}), greedy, {args.draft_tokens} draft tokens, "
        f"min accept {args.min_accept:g}, pause steps {args.pause_steps}, concurrency {args.concurrency}, "
        "one Engine: the off requests opt out "
        "per request (`disable_speculation`), rounds alternate on/off and off/on. Decode tok/s per request = "
        "(completion tokens - 1) / (last chunk - first chunk); medians over rounds (and prompts). "
        "Absolute rates move with the machine's load; the ratio within one alternating run is the figure.",
        "",
        "| workload | requests/mode | mean output tok | off tok/s (median) | on tok/s (median) | on/off | "
        "mean accept length | identical greedy text |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Scheduler speculation counters after the run: "
        f"`{ {k: v for k, v in state.items() if k.startswith('spec_')} }`",
        "",
    ])
    with open(args.out, "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
