"""Which knobs of --quantization w8a8_int8 buy back its perplexity: smoothing alpha per linear class, input channels
kept in float, which classes run int8 at all, and how much calibration text.

    python bench/int8_accuracy.py [--windows 6] [--calibration-tokens 48] VARIANT [VARIANT ...]

A VARIANT is `;`-separated `class=alpha[/float_channels]` terms over w_qkv, w_o, w_gate_up, w_down and lm_head (a
class left out, or `class=dense`, runs its dense float32 copy), e.g. `w_qkv=0.5;w_o=0.5;w_gate_up=0;lm_head=0.5`
(the mode's default plan) or `w_qkv=0.5/8;w_gate_up=0.3/16`. One model is loaded in --quantization w8a8_int8
--dtype float32 (eager); every class's calibration |x| is recorded once (runtime/models/int8_calibration.py), then
each variant re-rounds the int8 codes and scores --windows windows of bench/quant_ppl.py's held-out corpus through
the serving kernels (one forward per window: every call of >= 8 rows runs int8), against the same windows under
--quantization none --dtype float32. Prints one line per variant: perplexity change and seconds per window.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quant_ppl import corpus, nll_radixgen, windows  # noqa: E402

from kernels import quant  # noqa: E402
from kernels.quant.w8a8 import W8A8Weight  # noqa: E402
from runtime.config import make_config  # noqa: E402
from runtime.executor.model_runner import create_model_runner  # noqa: E402
from runtime.models import int8_calibration as cal  # noqa: E402
from runtime.models.registry import default_model_path  # noqa: E402

CLASSES = ("w_qkv", "w_o", "w_gate_up", "w_down", "lm_head")


def parse(variant: str) -> dict[str, tuple[float, int]]:
    plan: dict[str, tuple[float, int]] = {}
    for term in filter(None, variant.split(";")):
        name, _, val = term.partition("=")
        if name not in CLASSES:
            raise SystemExit(f"unknown class {name!r} in {variant!r}")
        if val != "dense":
            alpha, _, k = val.partition("/")
            plan[name] = (float(alpha), int(k or 0))
    return plan


class Switch:
    """Each (module, class) slot of the model: its W8A8Weight and its weight-only original with a float32 dense
    copy for calls of >= 8 rows (what --quantization w8a8_int8 runs for DENSE_CLASSES)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.slots: list[tuple[torch.nn.Module, str, W8A8Weight]] = []
        for m in model.modules():
            for name in CLASSES:
                w = m._modules.get(name)
                if isinstance(w, W8A8Weight):
                    assert isinstance(w.small, quant.QuantWeight)
                    if w.small.dense is None:
                        quant.keep_dense_copies(w.small, 8, torch.float32)
                    self.slots.append((m, name, w))

    def apply(self, plan: dict[str, tuple[float, int]]) -> None:
        for m, name, w in self.slots:
            if name in plan:
                alpha, k = plan[name]
                assert isinstance(w.small, quant.QuantWeight)
                w.smooth(w.small.dequantize(), alpha, k)
                setattr(m, name, w)
            else:
                setattr(m, name, w.small)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--calibration-tokens", type=int, default=cal.CALIBRATION_TOKENS)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    plans = [parse(v) for v in args.variants]
    path = default_model_path()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    chunks = windows(tok.encode(corpus()), args.window, args.window * args.windows)
    scored = sum(len(c) - 1 for c in chunks)
    runners = {}
    for mode in ("none", "gguf"):
        runners[mode] = create_model_runner(make_config(quantization=mode, dtype="float32",
                                                        max_total_tokens=args.window * 2, disable_compile=True),
                                            progress=False)
    ref = sum(nll_radixgen(runners["none"], c) for c in chunks) / scored
    runner = runners["gguf"]  # the mode's start: GGUF blocks, then its int8 wrapping
    t0 = time.perf_counter()
    seqs = cal.calibration_ids(runner.model, args.calibration_tokens)
    t1 = time.perf_counter()
    cal.observe(runner.model, CLASSES, 8, seqs)
    t2 = time.perf_counter()
    print(f"reference ppl {math.exp(ref):.3f} over {scored} tokens; calibration text {len(seqs)} x "
          f"{len(seqs[0])} tokens in {t1 - t0:.1f} s, observed in {t2 - t1:.1f} s", flush=True)
    sw = Switch(runner.model)
    for v, plan in zip(args.variants, plans, strict=True):
        sw.apply(plan)
        t = time.perf_counter()
        nll = sum(nll_radixgen(runner, c) for c in chunks) / scored
        dt = (time.perf_counter() - t) / len(chunks)
        print(f"{math.exp(nll - ref) - 1:+.2%}  ppl {math.exp(nll):.3f}  {dt:.2f} s/window  {v}", flush=True)


if __name__ == "__main__":
    main()
