"""The start-up lines that say which arithmetic each linear runs, for each weight mode, on this machine.

    .venv/bin/python bench/startup_lines.py [--modes none:float32 auto:auto w8a8_int8:auto] [--out FILE.md]

Each mode builds the model runner the scheduler process builds (the default model, eager, a small KV pool) with
the runner's log captured, and keeps the lines about weights: the weights line (mode, kernels, copies, panels), the
int8 plan line (per linear class, which arithmetic at which rows per call) and where the int8 calibration record
came from. A mode is `quantization:dtype`, as the server's --quantization and --dtype take them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from machine import describe  # noqa: E402

KEEP = ("weights:", "int8 arithmetic", "int8 calibration record", "panels", "kernel")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(k in msg for k in KEEP):
            self.lines.append(f"{record.name}: {msg}")


def mode_lines(quantization: str, dtype: str) -> tuple[list[str], float]:
    """The kept log lines of building the runner in this mode, and the seconds it took."""
    from runtime.config import make_config, resolve
    from runtime.executor.model_runner import create_model_runner

    handler = Lines()
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        t = time.perf_counter()
        cfg = make_config(quantization=quantization, dtype=dtype, compile_mode="off", max_total_tokens=4096)
        runner = create_model_runner(cfg, progress=False)
        took = time.perf_counter() - t
        del runner
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    mc = resolve(cfg).model
    return [f"resolved: --quantization {mc.quantization} --dtype {mc.dtype} --kv-cache-dtype {mc.kv_cache_dtype}"
            ] + handler.lines, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["none:float32", "auto:auto", "w8a8_int8:auto"])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = [f"# Start-up lines per weight mode\n\nMachine: {describe()}.\n",
           f"Command: `.venv/bin/python bench/startup_lines.py --modes {' '.join(args.modes)}"
           + (f" --out {args.out}`" if args.out else "`") + "\n"]
    for mode in args.modes:
        quantization, _, dtype = mode.partition(":")
        lines, took = mode_lines(quantization, dtype or "auto")
        out.append(f"## --quantization {quantization} --dtype {dtype or 'auto'} (runner built in {took:.1f} s)\n")
        out.append("```\n" + "\n".join(lines) + "\n```\n")
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
