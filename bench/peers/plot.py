"""Output tokens/s vs concurrency for every system; run with bench/.peers/venv-hf's python (it has matplotlib).

venv-hf/bin/python bench/peers/plot.py '{"radixgen": [[1, 20.1], [4, 70.3]], ...}' OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    series, out = json.loads(sys.argv[1]), sys.argv[2]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, pts in series.items():
        if pts:
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M, 2 CPU cores, 84-token prompts, 128 output tokens")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
