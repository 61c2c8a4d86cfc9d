"""Start-up of `radixgen serve` on the default model, each start timed as a whole process from its launch.

cold: an empty artifact cache (and an empty inductor cache): time to /health 200, decode tok/s delivered in
      the first 30 s (one greedy request of 32 tokens at a time, from /health on), time until every bucket is
      compiled (from /get_server_info; no load after the first 30 s so the background compiler has the CPU).
warm: the cache the cold start filled: time to /health 200, time until the end of the first request that a
      compiled graph decoded (requests of 4 tokens from /health on), time until every bucket runs compiled,
      then decode tok/s over 30 s.
Both: the artifact cache's size on disk after the start; cold starts also each compiled graph's seconds (the
compile worker's per-graph lines). Runs alternate cold/warm; medians over --rounds. Results:
bench/results/startup.md.

  python bench/startup.py --rounds 3 [--cold-rounds 1] [--compile-max-bs 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.machine import describe as describe_cpu  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _greedy(c: httpx.Client, n: int = 32) -> int:
    r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def _state(c: httpx.Client) -> dict:
    return c.get("/get_server_info").json()["internal_states"][0]


def _until_compiled(c: httpx.Client, out: dict[str, float], t0: float, pause: float, limit: float) -> None:
    """Sets first_compiled_s (launch to the end of the first request a compiled graph decoded) and
    all_compiled_s (launch until no bucket is pending). Gives up `limit` seconds after the launch."""
    st: dict = {}
    while time.monotonic() - t0 < limit:
        _greedy(c, 4)  # a step boundary: ready buckets swap in
        st = _state(c)
        if "first_compiled_s" not in out and st["compiled_replays"] > 0:
            out["first_compiled_s"] = time.monotonic() - t0
        if not st["pending_buckets"]:
            out["all_compiled_s"] = time.monotonic() - t0
            return
        time.sleep(pause)
    raise RuntimeError(f"decode graphs still pending {limit:g} s after the launch: {st}")


def one_start(cache: Path, inductor: Path, max_bs: int, cold: bool) -> dict[str, float]:
    port = _port()
    env = {**os.environ, "RADIXGEN_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    env.pop("RADIXGEN_DISABLE_COMPILE", None)
    cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--compile-max-bs", str(max_bs), "--log-level", "warning"]
    with tempfile.TemporaryFile() as log:  # the server's stdout: the compile worker's one JSON line per graph
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.DEVNULL)
        try:
            out = _measure(proc, port, t0, cold)
        finally:
            proc.terminate()
            proc.wait(30)
        log.seek(0)
        graphs = _compiled_graphs(log.read().decode(errors="replace"))
    out["graphs_compiled"] = len(graphs)
    out["compile_s_per_graph"] = statistics.mean(graphs) if graphs else 0.0
    out["cache_mb"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 1e6
    return out


def _measure(proc: subprocess.Popen[bytes], port: int, t0: float, cold: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300.0) as c:
        while True:
            try:
                if c.get("/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("server exited")
            time.sleep(0.05)
        out["health_s"] = time.monotonic() - t0
        if not cold:  # the cache holds every bucket: how soon does decode run compiled?
            _until_compiled(c, out, t0, 0.05, 120)
        tokens, t_first = 0, time.monotonic()
        while time.monotonic() - t_first < 30.0:
            tokens += _greedy(c)
        out["tok_s_first_30s"] = tokens / (time.monotonic() - t_first)
        if cold:  # no load meanwhile, so the background compiler has the CPU
            _until_compiled(c, out, t0, 0.5, 600)
        t, tokens = time.monotonic(), 0
        for _ in range(5):
            tokens += _greedy(c)
        out["compiled_tok_s"] = tokens / (time.monotonic() - t)
    return out


def _compiled_graphs(text: str) -> list[float]:
    """Seconds of each graph the compile worker wrote (its lines {"buckets": [...], "seconds": s})."""
    secs = []
    for line in text.splitlines():
        if line.startswith("{") and '"seconds"' in line:
            with contextlib.suppress(ValueError, KeyError):
                secs.append(float(json.loads(line)["seconds"]))
    return secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="warm starts")
    ap.add_argument("--cold-rounds", type=int, default=1)
    ap.add_argument("--compile-max-bs", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench/results/startup.md"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="radixgen-startup-"))
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    try:
        for i in range(max(a.rounds, a.cold_rounds)):
            if i < a.cold_rounds:
                shutil.rmtree(work, ignore_errors=True)
                runs["cold"].append(one_start(work / "graphs", work / "inductor", a.compile_max_bs, True))
                print("cold", runs["cold"][-1], flush=True)
            if i < a.rounds:
                runs["warm"].append(one_start(work / "graphs", work / "inductor", a.compile_max_bs, False))
                print("warm", runs["warm"][-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(a, runs)


def write(a: argparse.Namespace, runs: dict[str, list[dict[str, float]]]) -> None:
    cols = ("health_s", "first_compiled_s", "tok_s_first_30s", "all_compiled_s", "compiled_tok_s",
            "graphs_compiled", "compile_s_per_graph", "cache_mb")
    lines = ["# Start-up: time to /health, to compiled decode, and decode speed meanwhile", "",
             f"CPU: {describe_cpu()}", "",
             f"Command: `python bench/startup.py --rounds {a.rounds} --cold-rounds {a.cold_rounds} "
             f"--compile-max-bs {a.compile_max_bs}` (server: `radixgen serve --compile-max-bs {a.compile_max_bs}`, "
             "default model and flags, --compile-mode background). Each start is a whole process timed from its "
             "launch; cold: empty artifact and inductor caches; warm: the cache the cold start filled.", "",
             "| start | run | /health 200 (s) | first compiled decode (s) | decode tok/s, 30 s | "
             "every bucket compiled (s) | compiled tok/s | graphs compiled | s per graph | cache MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, rs in runs.items():
        for i, r in enumerate(rs):
            lines.append(f"| {kind} | {i + 1} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")
        if rs:
            lines.append(f"| {kind} | median | " + " | ".join(f"{statistics.median(r[c] for r in rs):.1f}"
                                                               for c in cols) + " |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
