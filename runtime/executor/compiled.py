"""The compiled CPU decode path: torch.compile (inductor, freezing) of the whole forward, one graph per
batch-size bucket, driven by the same runner as CUDA graphs (runtime/executor/cuda_graph.py).

Data flow per decode step of B <= max bucket requests: DecodeGraphRunner pads the step's vectors into its
static buffers, calls `attn.init_forward_graph(meta)` (host planning, eager), then `CompiledGraph.replay()`
runs the bucket's compiled forward. Inside it every linear is a prepacked oneDNN matmul (inductor freezing
turns the frozen parameters into constants and packs them), norms/rope/SiLU-mul are fused C++ loops, and
attention is the opaque custom op `radixgen_rt::attention` (runtime/models/attn_op.py), so any backend plugs in.
Extend and mixed steps run eagerly; a decode batch above the largest bucket replays that bucket once per
max_bs rows (64 rows at --compile-max-bs 32: two replays, 79 vs 85 ms per step eager, in-process on 2 Zen 4
cores).

Start-up: every bucket compiles before the server is ready, behind a progress bar, and the total time is
logged. Inductor's FX graph cache (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER) makes a second
start reuse the generated code. A compile failure falls back to eager with one warning naming the cause.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from kernels import fallbacks
from runtime.executor.cuda_graph import CPU_BUCKETS, DecodeGraphRunner, Forward, Graph, capture_buckets
from runtime.models.attn_op import PINNED_BASE, opaque_attend, register_backend

if TYPE_CHECKING:
    from kernels.api import BaseAttnBackend
    from runtime.config import ModelConfig
    from runtime.executor.compile_manager import CompileManager
    from runtime.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class CompiledGraph:
    """A `Graph` whose capture compiles `fn` for the static args' shapes and whose replay calls it again.
    dynamic=False: each bucket gets its own specialized graph (the runner only passes bucket shapes)."""

    def __init__(self) -> None:
        self.fn: Forward | None = None
        self.args: tuple[torch.Tensor, ...] = ()

    def capture(self, fn: Forward, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        import torch._inductor.config as inductor_config

        self.fn, self.args = torch.compile(fn, dynamic=False, fullgraph=True), args
        # freezing is read when the graph compiles (the first call); passing it in torch.compile's options
        # does not reach that decision in torch 2.13, the config patch does.
        with inductor_config.patch(freezing=True):
            return self.fn(*args)

    def replay(self) -> torch.Tensor:
        # Every replay passes the captured tensors themselves (same objects, shapes, strides, dtypes), so of
        # dynamo's guards only those that tell the buckets' cache entries apart need to run: the full guard set
        # (every parameter and buffer of the model) cost ~0.45 ms per decode step on a 2-core EPYC, 4 % of a
        # batch-1 step.
        assert self.fn is not None  # capture() ran first
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self.fn(*self.args)


def build_compiled_decode(model: LlamaForCausalLM, attn: BaseAttnBackend, req_to_token: torch.Tensor,
                          pad_slot: int, max_bs: int, progress: bool = True) -> DecodeGraphRunner | None:
    """Compile decode graphs for the CPU buckets up to `max_bs`; None (with one warning) if compiling fails."""
    import torch._dynamo

    buckets = capture_buckets(max_bs, CPU_BUCKETS)
    # one cache entry per bucket on the same code object; dynamo's default limit (8) would silently run
    # the extra buckets eagerly.
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(buckets) + 4)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * limit)
    bar = tqdm(total=len(buckets), desc="Compiling decode graphs", unit="bucket", disable=not progress)
    runner = DecodeGraphRunner(model, attn, req_to_token, pad_slot, max_bs, graph_factory=CompiledGraph,
                               attend=opaque_attend(register_backend(attn)), buckets=CPU_BUCKETS,
                               label="compiled graphs", on_bucket=lambda bs: bar.update(1), split_larger=True)
    t = time.perf_counter()
    try:
        runner.capture()
    except Exception as e:  # noqa: BLE001 (any compiler failure means: serve eagerly, loudly)
        fallbacks.record("compiled_decode", f"torch.compile of the decode forward failed ({type(e).__name__}: "
                                            f"{str(e).splitlines()[0] if str(e) else ''}): eager decode (slower)")
        return None
    finally:
        bar.close()
    msg = (f"compiled the decode forward for batch sizes {','.join(map(str, buckets))} "
           f"in {time.perf_counter() - t:.1f} s")
    log.info(msg)
    if progress:
        print(msg, flush=True)
    return runner


_packaged_runners = 0  # runners of this process on packaged graphs so far (the scheduler's first, a draft next)


def start_packaged_decode(mc: ModelConfig, model_path: str, model: LlamaForCausalLM, attn: BaseAttnBackend,
                          req_to_token: torch.Tensor, pad_slot: int, max_bs: int) -> CompileManager:
    """--compile-mode background/sync: decode graphs from AOTInductor packages in the artifact cache, each
    bucket replayed once loaded (runtime/executor/compile_manager.py). Cached buckets load now; the rest
    compile here (sync) or in a background process (background)."""
    import dataclasses

    from runtime.env import load_env
    from runtime.executor import aot_graph
    from runtime.executor.artifact_cache import ArtifactCache
    from runtime.executor.compile_manager import CompileManager

    global _packaged_runners
    # a pinned index, the same in every process that builds its runners in the same order (the worker too)
    backend_id = register_backend(attn, at=PINNED_BASE + _packaged_runners)
    _packaged_runners += 1
    graphs = DecodeGraphRunner(model, attn, req_to_token, pad_slot, max_bs,
                               graph_factory=_loads_only, attend=opaque_attend(backend_id), buckets=CPU_BUCKETS,
                               label="compiled graphs", split_larger=True)
    cache = ArtifactCache(mc.compile_cache_dir or load_env().cache_dir, mc.compile_cache_max_mb << 20)
    base = aot_graph.key_base(model_path, mc.dtype, mc.quantization, mc.quantization_kernel,
                              mc.kv_cache_dtype, mc.attention_backend, backend_id,
                              {"quantization_dense_rows": mc.quantization_dense_rows,
                               "quantization_group_size": mc.quantization_group_size,
                               "num_threads": mc.num_threads, "fallbacks": sorted(fallbacks.recorded())})
    job = {"model": {**dataclasses.asdict(mc), "model_path": model_path}, "backend_id": backend_id}
    manager = CompileManager(graphs, mc.compile_mode, cache, base, job)
    manager.start()
    return manager


def _loads_only() -> Graph:
    raise AssertionError("packaged decode graphs are added one bucket at a time (CompileManager)")
