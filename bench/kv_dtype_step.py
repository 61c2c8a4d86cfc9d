"""One question: what does a float16 KV pool (--kv-cache-dtype float16) buy a batch-1 decode step?

The default quantized SmolLM2 (float32 activations, native block kernels) with each KV pool dtype, one runner
each in one process, both after the same CTX-token prompt; decode steps in interleaved blocks of 8 (24 blocks per
dtype, the two dtypes at equal context lengths block by block); medians, and the median of the paired block
ratios against the first dtype. Compiled decode, as served.

    RADIXGEN_DISABLE_COMPILE=0 flock /tmp/radixgen-bench.lock python bench/kv_dtype_step.py [CTX] [float32,float16]
"""

from __future__ import annotations

import statistics
import sys
import time

from runtime.config import make_config
from runtime.executor.greedy import OfflineBatch
from runtime.executor.model_runner import create_model_runner

BLOCKS, STEPS = 24, 8


def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    kvs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["float32", "float16"]
    batches = {}
    for kv in kvs:
        runner = create_model_runner(make_config(max_total_tokens=ctx + 1024, kv_cache_dtype=kv), progress=False)
        b = OfflineBatch(runner, [list(range(100, 100 + ctx))])
        b.extend([list(range(100, 100 + ctx))])
        for i in range(STEPS):  # warm-up (compiled graph, caches)
            b.extend([[300 + i]], is_decode=True)
        batches[kv] = b
    ms: dict[str, list[float]] = {kv: [] for kv in kvs}
    for _ in range(BLOCKS):
        for kv in kvs:
            t0 = time.perf_counter()
            for i in range(STEPS):
                batches[kv].extend([[400 + i]], is_decode=True)
            ms[kv].append((time.perf_counter() - t0) / STEPS * 1e3)
    for kv in kvs:
        paired = [a / b for a, b in zip(ms[kv], ms[kvs[0]], strict=True)]
        print(f"kv {kv}: context {ctx}..{ctx + (BLOCKS + 1) * STEPS}: step ms median {statistics.median(ms[kv]):.2f} "
              f"(min {min(ms[kv]):.2f}); paired vs {kvs[0]}: median {statistics.median(paired):.3f}")


if __name__ == "__main__":
    main()
