"""Bounded soak: does radixgen keep serving, lose nothing and leak nothing for --minutes under ~70 % load?

Starts a real server, measures capacity (closed loop, 8 clients, 10 s), then offers Poisson arrivals at
--load x capacity of short streaming /generate requests for --minutes, with random client kills (5 % of
requests closed after their first chunk), a bad input every 10 s (must be a 4xx), and at half time one
child-restart scenario: SIGKILL the scheduler, check that the server exits non-zero within 5 s leaving no
process, start a new server, continue. Reports requests served, errors by kind, p50/p99 TTFT per minute,
RSS of the server tree at start and end, and the idle KV invariant at the end. Writes --out (markdown).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.server.harness import ServerProc, alive, descendants  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "quick", "brown", "fox", "lazy", "dog", "sun"]
BAD = [
    b"{bad",
    b"[]",
    b'{"text": ""}',
    b'{"input_ids": [-1]}',
    b'{"text": "x", "sampling_params": {"top_p": 0}}',
    b'{"text": "x", "sampling_params": {"regex": "(("}}',
    b'{"text": "x", "sampling_params": {"n": 0}}',
]


def rss_mb(pid: int) -> float:
    total = 0
    for p in {pid} | descendants(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 1024


def rss_by_process(pid: int) -> dict[str, float]:
    """MiB of resident memory per process name (server, rg-scheduler, rg-detokenizer, grammar workers)."""
    out: dict[str, float] = collections.defaultdict(float)
    for p in {pid} | descendants(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        out["server" if p == pid else comm(p)] += kb / 1024
    return dict(out)


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def body(rng: random.Random, max_new: int) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    return {"text": text, "stream": True, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.7}}


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rng = args, random.Random(args.seed)
        self.errors: collections.Counter[str] = collections.Counter()
        self.served = 0
        self.ttft: dict[int, list[float]] = collections.defaultdict(list)
        self.t0 = 0.0
        self.server: ServerProc | None = None
        self.url = ""
        self.notes: list[str] = []
        self.epoch = 0  # bumped when the restart scenario kills the scheduler
        self.rss: dict[int, dict[str, float]] = {}  # minute -> MiB per process, sampled once a minute

    def start_server(self) -> None:
        self.server = ServerProc("--max-total-tokens", "8192", "--log-level", "warning").wait_ready(300)
        self.url = self.server.url
        self.notes.append(
            f"server pid {self.server.proc.pid} RSS at start {rss_mb(self.server.proc.pid):.0f} MiB"
        )

    async def one(self, client: httpx.AsyncClient, kill: bool, record: bool = True) -> None:
        start, epoch = time.monotonic(), self.epoch
        try:
            async with client.stream(
                "POST", f"{self.url}/generate", json=body(self.rng, self.args.max_new)
            ) as r:
                if r.status_code != 200:
                    self.errors[f"http_{r.status_code}"] += 1
                    return
                first = True
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if '"error"' in line:
                        self.errors[self._lost(epoch, "stream_error")] += 1
                        return
                    if first and record:
                        first = False
                        self.ttft[int((start - self.t0) // 60)].append(time.monotonic() - start)
                    if kill:
                        self.errors["client_killed (intended)"] += 1
                        return
            self.served += 1
        except httpx.HTTPError as e:
            self.errors[self._lost(epoch, f"transport_{type(e).__name__}")] += 1

    def _lost(self, epoch: int, kind: str) -> str:
        """A request in flight when the restart scenario killed the scheduler is lost on purpose."""
        return "in_flight_at_restart (intended)" if epoch != self.epoch else kind

    async def capacity(self, client: httpx.AsyncClient, seconds: float = 10.0) -> float:
        done, end = 0, time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                await self.one(client, False, record=False)
                done += 1

        self.served = 0
        await asyncio.gather(*(worker() for _ in range(8)))
        self.served, self.errors = 0, collections.Counter()
        return done / seconds

    async def bad_input(self, client: httpx.AsyncClient) -> None:
        raw = self.rng.choice(BAD)
        r = await client.post(
            f"{self.url}/generate", content=raw, headers={"content-type": "application/json"}
        )
        self.errors[
            "bad_input_ok (4xx)" if 400 <= r.status_code < 500 else f"bad_input_WRONG_{r.status_code}"
        ] += 1

    def restart(self) -> None:
        srv = self.server
        tree = descendants(srv.proc.pid)
        sched = [p for p in tree if comm(p) == "rg-scheduler"]
        t = time.monotonic()
        os.kill(sched[0], signal.SIGKILL)
        self.epoch += 1
        try:
            srv.proc.wait(5)
            code = srv.proc.returncode
        except Exception:
            code = None
        took = time.monotonic() - t
        time.sleep(0.5)
        orphans = [p for p in tree if alive(p)]
        self.restart_ok = code not in (None, 0) and took < 5 and not orphans
        self.notes.append(
            f"restart: scheduler SIGKILL -> exit code {code} in {took:.2f} s, orphans {orphans}; "
            f"RSS before kill {self.rss_before_kill:.0f} MiB"
        )
        srv.stop()
        self.start_server()

    async def run(self) -> dict:
        self.start_server()
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as client:
            cap = await self.capacity(client)
            rate = max(0.2, self.args.load * cap)
            self.notes.append(f"capacity {cap:.2f} req/s (8 closed-loop clients); offered {rate:.2f} req/s")
            self.t0 = time.monotonic()
            end = self.t0 + self.args.minutes * 60
            half, next_bad, restarted = self.t0 + self.args.minutes * 30, self.t0 + 10, False
            tasks: set[asyncio.Task] = set()
            while (now := time.monotonic()) < end:
                minute = int((now - self.t0) // 60)
                if minute not in self.rss:
                    self.rss[minute] = rss_by_process(self.server.proc.pid)
                if not restarted and now >= half:
                    restarted = True
                    self.rss_before_kill = rss_mb(self.server.proc.pid)
                    await asyncio.get_running_loop().run_in_executor(None, self.restart)
                    continue
                if now >= next_bad:
                    next_bad += 10
                    tasks.add(asyncio.ensure_future(self.bad_input(client)))
                kill = self.rng.random() < 0.05
                tasks.add(asyncio.ensure_future(self.one(client, kill)))
                tasks = {t for t in tasks if not t.done()}
                await asyncio.sleep(self.rng.expovariate(rate))
            await asyncio.gather(*tasks, return_exceptions=True)
            deadline, st = time.monotonic() + 10, {}
            while time.monotonic() < deadline:
                st = (await client.get(f"{self.url}/get_server_info")).json()["internal_states"][0]
                if self.leak_ok(st):
                    break
                await asyncio.sleep(0.1)
        rss_end = rss_mb(self.server.proc.pid)
        self.rss[int((time.monotonic() - self.t0) // 60) + 1] = rss_by_process(self.server.proc.pid)
        leak_log = "leak" in self.server.output.lower()
        self.server.stop()
        return {
            "cap": cap,
            "rate": rate,
            "state": st,
            "leak_ok": self.leak_ok(st) and not leak_log,
            "rss_end": rss_end,
            "restart_ok": getattr(self, "restart_ok", False),
        }

    @staticmethod
    def leak_ok(st: dict) -> bool:
        return (
            st.get("num_running_reqs") == 0
            and st.get("num_waiting_reqs") == 0
            and st["kv_free_slots"] + st["kv_evictable_slots"] == st["max_total_num_tokens"]
        )


def report(soak: Soak, res: dict, args: argparse.Namespace) -> str:
    lines = [
        f"# Soak: {args.minutes:g} minute(s), {args.label}",
        "",
        f"- requests served to completion: {soak.served}",
        f"- leak invariant at the end (idle, free + evictable == total, no 'leak' log line): "
        f"{'holds' if res['leak_ok'] else 'BROKEN'} ({res['state']})",
        f"- child restart scenario: {'ok' if res['restart_ok'] else 'FAILED'}",
        f"- RSS of the final server tree at end: {res['rss_end']:.0f} MiB",
        *[f"- {n}" for n in soak.notes],
        "",
        "| errors by kind | count |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(soak.errors.items())],
        "",
        "| minute | requests with a first token | p50 TTFT (s) | p99 TTFT (s) |",
        "|---|---|---|---|",
    ]
    for m in sorted(soak.ttft):
        xs = sorted(soak.ttft[m])
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        lines.append(f"| {m} | {len(xs)} | {statistics.median(xs):.3f} | {p99:.3f} |")
    names = sorted({n for row in soak.rss.values() for n in row})
    lines += [
        "",
        "RSS (MiB) per process, sampled at the start of each minute (the restart replaces every process):",
        "",
        "| minute | " + " | ".join(names) + " | total |",
        "|---" * (len(names) + 2) + "|",
    ]
    for m in sorted(soak.rss):
        row = soak.rss[m]
        cells = " | ".join(f"{row.get(n, 0):.0f}" for n in names)
        lines.append(f"| {m} | {cells} | {sum(row.values()):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of measured capacity to offer")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="quiet machine")
    ap.add_argument("--out", default="bench/results/soak.md")
    args = ap.parse_args(argv)
    soak = Soak(args)
    try:
        res = asyncio.run(soak.run())
    finally:
        if soak.server is not None:
            soak.server.stop()
    text = report(soak, res, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return {**res, "served": soak.served, "errors": dict(soak.errors)}


if __name__ == "__main__":
    main()
