"""KV memory one long request holds on a real server, window-aware pool against one full-attention pool.

For each pool layout (`hybrid`: the default two pools; `single`: `--disable-hybrid-swa-memory`) this starts
`radixgen serve` on the model, sends one request of PROMPT random token ids + OUT greedy tokens (8,192 in all by
default) and polls /get_server_info while it runs. A request holds the slots that are neither free nor the
prefix cache's evictable ones: full pool `max_total_num_tokens - kv_free_slots - kv_evictable_slots`, sliding
pool `swa_total_slots - swa_free_slots - swa_evictable_slots`. Bytes = slots x layers of that pool x K+V bytes
per layer and slot (kv heads x head dim x 2 x element size). Printed: the peak while prefilling and the last
reading while decoding (the request past PROMPT tokens), per layout, as a markdown table.

    .venv/bin/python bench/swa_memory.py --gguf MODEL.gguf [--prompt 8000 --out 192]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from machine import describe  # noqa: E402

ELT = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def held(st: dict) -> tuple[int, int]:
    """(full-pool slots, sliding-pool slots) held by running requests in one internal_states reading."""
    full = st["max_total_num_tokens"] - st["kv_free_slots"] - st["kv_evictable_slots"]
    swa = st["swa_total_slots"] - st["swa_free_slots"] - st["swa_evictable_slots"] if "swa_total_slots" in st else 0
    return full, swa


def serve(args: argparse.Namespace, single: bool, port: int) -> subprocess.Popen:
    cmd = [os.path.join(ROOT, ".venv", "bin", "radixgen"), "serve", "--model-path", args.gguf, "--host", "127.0.0.1",
           "--port", str(port), "--compile-mode", "off", "--num-threads", "2",
           "--max-total-tokens", str(args.pool), *(["--disable-hybrid-swa-memory"] if single else [])]
    log = open(f"/tmp/swa_memory_{port}.log", "w")  # noqa: SIM115  (the child's for its lifetime)
    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)


def measure(args: argparse.Namespace, single: bool, port: int) -> dict:
    proc = serve(args, single, port)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > 600:
                raise SystemExit(f"server not ready (exit {proc.poll()}): /tmp/swa_memory_{port}.log")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        rng = random.Random(0)
        ids = [rng.randrange(256, 49152) for _ in range(args.prompt)]
        body = {"prompt": ids, "max_tokens": args.out, "temperature": 0.0, "ignore_eos": True, "stream": True}
        got = {"tokens": 0}

        def send() -> None:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=1800) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got["tokens"] += 1

        th = threading.Thread(target=send)
        th.start()
        prefill_peak, decode_last, info = (0, 0), (0, 0), {}
        while th.is_alive():
            info = httpx.get(base + "/get_server_info", timeout=30).json()
            st = info["internal_states"][0]
            h = held(st)
            if got["tokens"] <= 1:
                prefill_peak = max(prefill_peak, h, key=sum)
            elif got["tokens"] < args.out - 2:
                decode_last = h
            time.sleep(0.25)
        th.join()
        return {"layout": "single" if single else "hybrid", "state": info["internal_states"][0],
                "kv_dtype": info.get("kv_cache_dtype") or "?", "prefill_peak": prefill_peak, "decode": decode_last,
                "tokens": got["tokens"]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--out", type=int, default=192)
    ap.add_argument("--pool", type=int, default=16384, help="--max-total-tokens of each server")
    ap.add_argument("--layers", default="3,15", help="global,sliding layer counts (Gemma 3 270M: 3,15)")
    ap.add_argument("--kv-bytes-per-layer", type=int, default=2 * 1 * 256,
                    help="K+V values per layer and slot (2 x kv heads x head dim; Gemma 3 270M: 512)")
    ap.add_argument("--port", type=int, default=34300)
    args = ap.parse_args()
    n_full, n_swa = (int(x) for x in args.layers.split(","))
    rows = []
    for i, single in enumerate((False, True)):
        r = measure(args, single, args.port + i)
        elt = ELT.get(str(r["kv_dtype"]).replace("torch.", ""), 0)
        print(json.dumps({k: v for k, v in r.items() if k != "state"}), flush=True)
        for phase in ("prefill_peak", "decode"):
            full, swa = r[phase]
            layers_full = n_full + n_swa if single else n_full
            mib = (full * layers_full + swa * n_swa) * args.kv_bytes_per_layer * elt / 2**20
            rows.append(f"| {r['layout']} | {phase} | {full} | {swa} | {mib:.1f} |")
    print(f"\n{describe()}; {args.prompt} prompt + {args.out} output tokens, pool {args.pool} slots, "
          f"KV {r['kv_dtype']}\n")
    print("| pool | phase | full-pool slots held | sliding-pool slots held | MiB held |")
    print("|---|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
