"""Predicted outputs (OpenAI `prediction`) on an edit-a-file workload: n-gram speculation with the original file
as the prediction vs without it (prompt lookup alone), and speculation off as the baseline.

Each request gives SmolLM2 a short Python file and asks for the whole file back with one name renamed, so the
answer is a lightly edited copy of the prediction. One `runtime.Engine` with `--speculative-algorithm ngram`,
greedy, float32 dense weights (`--quantization none`, where greedy output does not depend on how a step is
batched, so the three arms must give identical text); the "off" requests opt out per request
(`disable_speculation`). The arms alternate in a rotated order every round. Decode rate of one request =
(completion_tokens - 1) / (time of the last chunk - time of the first chunk), from a streaming request, so
prefill is excluded. Per arm: the median decode tok/s over files x rounds, the ratio to "off", the drafts
accepted / drafts verified (meta_info spec_accepted_tokens / spec_draft_tokens), and whether every file's
text was identical across the arms. Writes bench/results/prediction.md (or --out).

    python bench/prediction.py [--rounds 3] [--max-new 320] [--draft-tokens 4] [--files 4]
                               [--arms off,ngram,ngram+prediction] [--out FILE]
RADIXGEN_DISABLE_COMPILE=1 runs every decode step eagerly (as verify steps always run); the results file says
which.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import describe  # noqa: E402

from runtime import Engine  # noqa: E402

FILES = [
    ("total", "amount", '''def total(items, tax):
    """Sum of the item prices, with tax."""
    total = 0.0
    for name, price, count in items:
        if count <= 0:
            continue
        total += price * count
    total = total * (1.0 + tax)
    return round(total, 2)


def cheapest(items):
    best = None
    for name, price, count in items:
        if best is None or price < best[1]:
            best = (name, price)
    return best
'''),
    ("rows", "records", '''import csv


def load(path):
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(row)
    return rows


def by_city(rows):
    out = {}
    for row in rows:
        out.setdefault(row["city"], []).append(row)
    return out


def count(rows, city):
    return len([row for row in rows if row["city"] == city])
'''),
    ("queue", "pending", '''class Worker:
    def __init__(self, queue, limit):
        self.queue = queue
        self.limit = limit
        self.done = []

    def step(self):
        if not self.queue:
            return False
        job = self.queue.pop(0)
        if len(self.done) < self.limit:
            self.done.append(job)
        return True

    def run(self):
        while self.step():
            pass
        return self.done
'''),
    ("grid", "board", '''def make(width, height):
    grid = [[0] * width for _ in range(height)]
    return grid


def neighbours(grid, x, y):
    out = 0
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            if dx == 0 and dy == 0:
                continue
            if 0 <= y + dy < len(grid) and 0 <= x + dx < len(grid[0]):
                out += grid[y + dy][x + dx]
    return out
'''),
]
ARMS = ("off", "ngram", "ngram+prediction")


def prompt(old: str, new: str, code: str) -> str:
    return (f"Here is a Python file:\n\n{code}\nRewrite the whole file with `{old}` renamed to `{new}`. "
            "Reply with the code only.")


def one(engine: Engine, ids: list[int], code: str, arm: str, max_new: int) -> dict:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "disable_speculation": arm == "off"}
    first = last = None
    out = None
    kw = {"prediction": code} if arm == "ngram+prediction" else {}
    for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True, **kw):
        now = time.perf_counter()
        if first is None and chunk["output_ids"]:
            first = now
        last, out = now, chunk
    meta = out["meta_info"]
    n = meta["completion_tokens"]
    return {"rate": (n - 1) / (last - first) if n > 1 and last > first else 0.0, "tokens": n, "text": out["text"],
            "accepted": meta.get("spec_accepted_tokens", 0), "drafted": meta.get("spec_draft_tokens", 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--files", type=int, default=len(FILES), help="use the first N files")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "prediction.md"))
    args = ap.parse_args()
    arms = tuple(a for a in ARMS if a in args.arms.split(","))
    files = FILES[: args.files]
    engine = Engine(max_total_tokens=8192, dtype="float32", quantization="none", speculative_algorithm="ngram",
                    speculative_num_draft_tokens=args.draft_tokens, log_level="warning")
    try:
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": prompt(o, n, c)}]) for o, n, c in files]
        one(engine, prompts[0], files[0][2], "off", 16)  # warm-up
        runs: dict[str, list[dict]] = {a: [] for a in arms}
        texts: dict[tuple[str, int], set[str]] = {}
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            for i, (_, _, code) in enumerate(files):
                for arm in order:
                    res = one(engine, prompts[i], code, arm, args.max_new)
                    runs[arm].append(res)
                    texts.setdefault(("all", i), set()).add(res["text"])
                    print(f"round {r} file {i} {arm:17s} {res['rate']:6.1f} tok/s  {res['tokens']} tokens  "
                          f"accepted {res['accepted']}/{res['drafted']}", flush=True)
    finally:
        engine.shutdown()
    identical = all(len(v) == 1 for v in texts.values())
    base = statistics.median(x["rate"] for x in runs[arms[0]])
    rows = []
    for arm in arms:
        rs = runs[arm]
        rate = statistics.median(x["rate"] for x in rs)
        acc, dr = sum(x["accepted"] for x in rs), sum(x["drafted"] for x in rs)
        share = f"{acc / dr:.2f} ({acc}/{dr})" if dr else "-"
        rows.append(f"| {arm} | {rate:.1f} | {rate / base:.2f}x | {share} | {statistics.median(x['tokens'] for x in rs):.0f} |")
    eager = os.environ.get("RADIXGEN_DISABLE_COMPILE") == "1"
    cmd = (("RADIXGEN_DISABLE_COMPILE=1 " if eager else "") + f"python bench/prediction.py --rounds {args.rounds} "
           f"--max-new {args.max_new} --draft-tokens {args.draft_tokens} --files {args.files} --arms {','.join(arms)}")
    text = f"""# Predicted outputs on an edit-a-file workload

Machine: {describe()}, torch {__import__("torch").__version__}.
Date: {time.strftime("%Y-%m-%d")}. Command: `{cmd}`

SmolLM2-135M-Instruct, float32 dense weights (`--quantization none`), greedy, one request at a time, decode
steps {"eager" if eager else "compiled"}. Each of {len(files)} short Python files (15-20 lines) is sent with "rewrite the whole file with one name renamed"; the
prediction is the original file, so the expected answer is a lightly edited copy of it. Arms alternate in a
rotated order each round; {args.rounds} rounds; decode tokens/s per request (prefill excluded), median over
files x rounds. "accepted" is drafts accepted / drafts verified over all the arm's requests
(`meta_info.spec_accepted_tokens / spec_draft_tokens`; the chat route reports the same two counts as
`usage.completion_tokens_details`). Without a prediction the n-gram proposer looks the suffix up in the
prompt, which holds the original file too.

| arm | decode tok/s | vs {arms[0]} | accepted | output tokens (median) |
|---|---:|---:|---:|---:|
{chr(10).join(rows)}

Greedy text identical across the arms for every file: {"yes" if identical else "NO"}.
"""
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
