"""Greedy agreement of speculation on vs off in bfloat16 (the default dtype), and where the texts part.

In float32 the outputs are identical (tests/runtime/speculative/test_model.py). In bf16 a verify row's logits
come from an extend over several positions, a decode row's from one: the rounding differs, so where the top
two tokens are nearly tied the argmax may flip and the texts part. This runs the 30 prompts of the float32
test (max_new tokens each, ignore_eos) in one in-process scheduler over a bf16 runner: wave 1 opted out,
wave 2 speculating. For every pair that differs it recomputes, in one fresh forward, the logits at the first
differing position and reports the gap between the two tokens chosen (logit units; bf16 resolves about 0.06
at a logit of 16). Prints a markdown block.

    python bench/speculative_bf16.py [--max-new 32] [--quantization auto]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("RADIXGEN_DISABLE_COMPILE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.config import make_config  # noqa: E402
from runtime.executor.greedy import OfflineBatch  # noqa: E402
from runtime.executor.model_runner import create_model_runner  # noqa: E402
from runtime.models.registry import default_model_path  # noqa: E402
from runtime.tokenizer.load import load_tokenizer  # noqa: E402
from tests.runtime import test_speculative_model as spec_tests  # noqa: E402
from tests.runtime.scheduler.driver import Driver  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    path = default_model_path()
    runner = create_model_runner(make_config(model_path=path, dtype="bfloat16", quantization=args.quantization,
                                             max_total_tokens=8192), progress=False)
    tok = load_tokenizer(path)
    prompts = spec_tests.prompts.__wrapped__(tok)
    d = Driver(runner, tok, **spec_tests.SPEC)
    for rid, ids in prompts.items():
        d.submit(f"off_{rid}", ids, args.max_new, ignore_eos=True, disable_speculation=True)
    d.run()
    for rid, ids in prompts.items():
        d.submit(rid, ids, args.max_new, ignore_eos=True)
    d.run()
    st = d.sched.internal_state()
    d.close()
    rows = []
    for rid, ids in prompts.items():
        on, off = d.ids(rid), d.ids(f"off_{rid}")
        if on == off:
            continue
        i = next(j for j, (a, b) in enumerate(zip(on, off, strict=True)) if a != b)
        seq = ids + off[:i]
        batch = OfflineBatch(runner, [seq])
        try:
            logits = batch.extend([seq])[0].float()
        finally:
            batch.release()
        gap = abs(float(logits[on[i]] - logits[off[i]]))
        rows.append(f"| {rid} | {i} | {off[i]} / {on[i]} | {gap:.3f} |")
    same = len(prompts) - len(rows)
    print(f"bf16 (quantization {args.quantization}), {len(prompts)} prompts x {args.max_new} tokens: "
          f"{same}/{len(prompts)} identical ({100 * same / len(prompts):.0f}%); accept length "
          f"{st['spec_accept_length']:.2f}, accept rate {st['spec_accept_rate']:.2f}\n")
    if rows:
        print("| request | first differing token | off / on token | logit gap at that position |")
        print("|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
