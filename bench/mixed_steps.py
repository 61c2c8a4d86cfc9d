"""How many steps, stalls and forward tokens does a RAG wave cost with mixed steps vs separated steps?

    .venv/bin/python bench/mixed_steps.py [--questions 32] [--per-step 4] [--rounds 3] [--dtype bfloat16]

The scheduler on the real SmolLM2 runner, in process: one request is decoding when 32 questions about a new
~1,550-token report (bench/peers/workloads.py's RAG prompts) arrive `--per-step` per step (HTTP arrivals
trickle in). Per mode: forward steps, stall steps by reason, extend tokens computed (the report should be
computed once), time to first token in steps (p50, max) and wall seconds. Modes alternate within each round;
the table shows medians over rounds. Step and token counts do not depend on machine load; the wall times do.
Writes its table to --out (mixed_steps_inprocess.md in bench/results by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))

import workloads as W  # noqa: E402

from runtime.config import make_config  # noqa: E402
from runtime.executor.model_runner import create_model_runner  # noqa: E402
from runtime.messages import TokenizedGenerateReq  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402
from runtime.scheduler import Scheduler  # noqa: E402
from runtime.tokenizer.load import load_tokenizer  # noqa: E402

MODES = {"mixed": {}, "separated": {"disable_mixed_steps": True}}


def run_once(runner, tok, prompts: list[list[int]], per_step: int, mode: dict) -> dict:
    cfg = make_config(max_total_tokens=runner.allocator.num_slots, max_running_requests=runner.req_to_token.size,
                      **mode)
    sched = Scheduler(runner, runner.allocator, runner.req_to_token, cfg, runner.eos_token_ids, tok.decode)
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    sched.handle(TokenizedGenerateReq(rid="chat", input_ids=tok.encode("Tell me a long story."), sampling_params=sp))
    sched.step()  # the running request
    first: dict[str, int] = {}
    arrive: dict[str, int] = {}
    todo = list(enumerate(prompts))
    t0, n = time.perf_counter(), 0
    while todo or sched.has_work():
        for i, ids in todo[:per_step]:
            sched.handle(TokenizedGenerateReq(rid=f"q{i}", input_ids=ids, sampling_params=sp))
            arrive[f"q{i}"] = n
        todo = todo[per_step:]
        for o in sched.step():
            if o.new_ids and o.rid not in first:
                first[o.rid] = n
        n += 1
    wall = time.perf_counter() - t0
    st = sched.internal_state()
    ttft = [first[r] - arrive[r] + 1 for r in arrive]
    assert sched.flush_cache().success
    return {"steps": st["forward_steps"], "stall": st["stall_steps"], "mixed": st["mixed_steps"],
            "extend_tokens": st["prefill_tokens"], "ttft_p50": statistics.median(ttft), "ttft_max": max(ttft),
            "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--per-step", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "mixed_steps_inprocess.md"))
    args = ap.parse_args()
    runner = create_model_runner(make_config(dtype=args.dtype, max_total_tokens=16384), progress=False)
    tok = load_tokenizer(runner.model_path)
    res: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        prompts = [tok.encode_chat(q.messages) for q in W.rag(100 + r, args.questions)]
        for m, mode in (MODES.items() if r % 2 == 0 else reversed(MODES.items())):
            res[m].append(run_once(runner, tok, prompts, args.per_step, mode))
            print(f"round {r + 1} {m:9s} {res[m][-1]}", flush=True)
    keys = ["steps", "stall", "mixed", "extend_tokens", "ttft_p50", "ttft_max", "wall"]
    lines = [f"# Mixed vs separated steps, RAG wave in process ({args.questions} questions, {args.per_step} "
             f"arriving per step, one request decoding; {args.dtype}; medians of {args.rounds} rounds)", "",
             "| mode | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for m, rs in res.items():
        lines.append(f"| {m} | " + " | ".join(f"{statistics.median(x[k] for x in rs):.4g}" for k in keys) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
