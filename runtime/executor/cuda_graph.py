"""Decode graphs per batch-size bucket, replayed for the smallest bucket >= B: CUDA graphs on GPU, and the
same runner with torch.compile'd graphs on CPU (runtime/executor/compiled.py supplies that `Graph`).

A SmolLM2 decode step is ~300 small kernels; at small batches their launch overhead is the step. Captured
once as a graph, the whole forward replays with one launch.

Data flow per replay (`replay(fb)`):
  fb's host vectors, padded to the bucket  --one pinned copy-->  static device buffers [6, bucket]
  attn.init_forward_graph(meta over the static buffers)          (FlashInfer plans here; Triton: nothing)
  graph.replay()                                                  (kernels read only static/fixed buffers)
  -> logits view [B, V] into the bucket's output (CUDA: a static buffer; compiled CPU: a fresh tensor)

Padding rows (bucket > B) decode token 0 at position 0 with seq_len 1 over table row 0, and store their
K/V into the pool's pad slot (`KVPool.pad_slot`), which no request owns; their logits are dropped.

Invariants:
  - Nothing host-side runs inside a replay: only `init_forward_graph` (before it) may do host work, and it
    must update the backend's buffers in place.
  - Graphs stay valid while the weights, the KV pool and req_to_token are the same tensors.
  - The returned logits are a view valid until the next forward (the bucket's output buffer is reused).
The graph object is injectable (`graph_factory`) so the padding and buffer logic is tested on CPU with
an eager stand-in that re-runs the captured function; the captured function is `forward(ids, pos, logit_idx)`
over views of the static buffers (an nn.Module, so a compiling `Graph` sees the weights as parameters).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from runtime.executor.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from kernels.api import BaseAttnBackend
    from runtime.models.llama import Attend, LlamaForCausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# CPU compiles cost tens of seconds each (a CUDA capture: milliseconds), so fewer, coarser buckets there.
CPU_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
IDS, POS, LOC, ROWS, SEQ, PRE = range(6)  # rows of the static metadata buffer


def capture_buckets(max_bs: int, standard: tuple[int, ...] = BUCKETS) -> tuple[int, ...]:
    """Batch sizes to capture: the standard buckets below `max_bs`, then `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"decode graph max batch size must be >= 1, got {max_bs}")
    return tuple(b for b in standard if b < max_bs) + (max_bs,)


def bucket_for(buckets: tuple[int, ...], bs: int) -> int | None:
    """The smallest bucket >= bs, or None when bs is larger than every bucket."""
    i = bisect.bisect_left(buckets, bs)
    return buckets[i] if i < len(buckets) else None


def pad_decode_metadata(fb: ForwardBatch, bucket: int, pad_slot: int) -> torch.Tensor:
    """The static buffer contents for `fb` padded to `bucket` rows: int64 [6, bucket] (IDS .. PRE rows)."""
    bs = fb.batch_size
    out = torch.zeros((6, bucket), dtype=torch.int64)
    out[IDS, :bs] = fb.input_ids
    out[POS, :bs] = fb.positions
    out[LOC, :bs] = fb.out_cache_loc
    out[ROWS, :bs] = fb.req_pool_indices
    out[SEQ, :bs] = torch.tensor(fb.seq_lens, dtype=torch.int64)
    out[PRE, :bs] = torch.tensor(fb.prefix_lens, dtype=torch.int64)
    out[LOC, bs:] = pad_slot
    out[SEQ, bs:] = 1  # token 0 at position 0 over table row 0; prefix 0
    return out


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, pos, logit_idx) -> logits


class Graph(Protocol):
    def capture(self, fn: Forward, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Run/record `fn(*args)` once (args: views of the static buffers); returns its output."""
        ...

    def replay(self) -> torch.Tensor:
        """Re-run over the same static buffers; returns the output (CUDA: the captured tensor, overwritten)."""
        ...


class TorchCudaGraph:
    """torch.cuda.CUDAGraph over a memory pool shared by all buckets (largest captured first)."""

    def __init__(self, pool: torch.cuda._POOL_HANDLE, stream: torch.cuda.Stream) -> None:
        self.pool, self.stream = pool, stream
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self, fn: Forward, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.stream.wait_stream(torch.cuda.current_stream())  # the static buffers were filled there
        with torch.cuda.stream(self.stream):  # warm-up: Triton JIT, cuBLAS workspaces, allocator blocks
            for _ in range(2):
                fn(*args)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            self.out = fn(*args)
        return self.out

    def replay(self) -> torch.Tensor:
        assert self.graph is not None  # capture() ran first
        self.graph.replay()
        return self.out


class DecodeBody(torch.nn.Module):
    """The captured function: the model's forward over the static buffers, attention through `attend`."""

    def __init__(self, model: LlamaForCausalLM, attend: Attend) -> None:
        super().__init__()
        self.model, self.attend = model, attend

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, logit_idx: torch.Tensor) -> torch.Tensor:
        return self.model.forward_tokens(ids, pos, logit_idx, self.attend)


class DecodeGraphRunner:
    """Decode forwards of up to `max_bs` requests through captured graphs. `model.forward_tokens(ids, pos,
    logit_idx, attend)` is the forward (attend defaults to `attn.forward`); on CUDA `attn` must keep every
    device buffer its decode kernels read fixed across steps."""

    def __init__(self, model: LlamaForCausalLM, attn: BaseAttnBackend, req_to_token: torch.Tensor, pad_slot: int,
                 max_bs: int, graph_factory: Callable[[], Graph] | None = None, attend: Attend | None = None,
                 buckets: tuple[int, ...] = BUCKETS, label: str = "CUDA graphs",
                 on_bucket: Callable[[int], None] | None = None, split_larger: bool = False) -> None:
        self.model, self.attn = model, attn
        self.body = DecodeBody(model, attend or attn.forward)
        self.label, self.on_bucket = label, on_bucket
        # split_larger: a decode batch above the largest bucket replays it once per max_bs rows (the CPU
        # compiled path, where that beats the eager forward); else it runs eagerly (CUDA: large batches keep
        # the GPU busy without a graph).
        self.split_larger = split_larger
        self.req_to_token = req_to_token
        self.device = req_to_token.device
        self.pad_slot = pad_slot
        self.buckets = capture_buckets(max_bs, buckets)
        self.max_bs = self.buckets[-1]
        n = self.max_bs
        self.static = torch.zeros((6, n), dtype=torch.int64, device=self.device)  # IDS .. PRE rows
        self.ones = torch.ones(n, dtype=torch.int64, device=self.device)
        self.arange = torch.arange(n, dtype=torch.int64, device=self.device)
        if graph_factory is None:
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            graph_factory = lambda: TorchCudaGraph(pool, stream)  # noqa: E731
        self.graph_factory = graph_factory
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        t = time.perf_counter()
        if self.attn.supports_cuda_graph:
            self.attn.init_cuda_graph_state(
                self.max_bs, self.buckets, self.model.arch.num_heads, self.req_to_token.shape[1]
            )
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
            self.add_graph(bs, self.graph_factory())
        self.capture_seconds = time.perf_counter() - t
        log.info("captured %d decode %s (batch sizes %s) in %.1f s",
                 len(self.buckets), self.label, ",".join(map(str, self.buckets)), self.capture_seconds)

    def prepare_bucket(self, bs: int) -> tuple[DecodeBody, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The captured function and its args for bucket `bs`, the static buffers holding all-padding rows."""
        self.static[:, :bs] = pad_decode_metadata(_empty_decode(), bs, self.pad_slot).to(self.device)
        self._init_attn(bs, (1,) * bs)
        return self.body, self._args(bs)

    @torch.inference_mode()
    def add_graph(self, bs: int, g: Graph) -> None:
        """Capture `g` for bucket `bs`; from then on decode batches that need only ready buckets replay them
        (a runner may fill its buckets one at a time, between steps)."""
        self.outputs[bs] = g.capture(*self.prepare_bucket(bs))
        self.graphs[bs] = g
        if self.on_bucket is not None:
            self.on_bucket(bs)

    def can_run(self, fb: ForwardBatch) -> bool:
        bs = fb.batch_size
        fits = bs <= self.max_bs or self.split_larger
        if not (fb.is_decode and fits and fb.logits_indices.numel() == bs):
            return False
        if bs <= self.max_bs:
            return bucket_for(self.buckets, bs) in self.graphs
        rest = bs % self.max_bs
        return self.max_bs in self.graphs and (rest == 0 or bucket_for(self.buckets, rest) in self.graphs)

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] float32 for a decode batch (a view into the bucket's output buffer when B <= max_bs;
        above it, a new tensor filled by one replay per max_bs rows, each row's logits those of its chunk)."""
        if fb.batch_size <= self.max_bs:
            return self._replay_one(fb)
        out = None
        for lo in range(0, fb.batch_size, self.max_bs):
            hi = min(lo + self.max_bs, fb.batch_size)
            part = self._replay_one(_decode_rows(fb, lo, hi))
            if out is None:
                out = torch.empty((fb.batch_size, *part.shape[1:]), dtype=part.dtype, device=part.device)
            out[lo:hi].copy_(part)  # before the next replay overwrites the bucket's output
        assert out is not None  # batch_size > max_bs: the loop ran
        return out

    def _replay_one(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        bucket = bucket_for(self.buckets, bs)
        assert bucket is not None  # callers pass at most max_bs rows
        host = pad_decode_metadata(fb, bucket, self.pad_slot)
        if self.device.type == "cuda":
            host = host.pin_memory()  # caching host allocator: the block outlives the async copy
        self.static[:, :bucket].copy_(host, non_blocking=True)
        self._init_attn(bucket, tuple(fb.seq_lens) + (1,) * (bucket - bs))
        out = self.graphs[bucket].replay()
        self.replays += 1
        return out[:bs]

    def _static_batch(self, bs: int, seq_lens_cpu: tuple[int, ...]) -> ForwardBatch:
        """A decode batch of `bs` rows over the static buffers (host lengths as given, one new token each)."""
        s = self.static
        return ForwardBatch(
            num_decode=bs, input_ids=s[IDS, :bs], positions=s[POS, :bs], out_cache_loc=s[LOC, :bs],
            req_pool_indices=s[ROWS, :bs], seq_lens=seq_lens_cpu, prefix_lens=tuple(x - 1 for x in seq_lens_cpu),
            extend_lens=(1,) * bs, logits_indices=self.arange[:bs],
        )

    def _init_attn(self, bs: int, seq_lens_cpu: tuple[int, ...]) -> None:
        s = self.static
        fb = self._static_batch(bs, seq_lens_cpu)
        self.attn.init_forward_graph(fb.attn_metadata(self.req_to_token, s[SEQ, :bs], s[PRE, :bs], self.ones[:bs]))

    def _args(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.static
        return s[IDS, :bs], s[POS, :bs], self.arange[:bs]


CudaGraphRunner = DecodeGraphRunner  # the name the CUDA path and its tests use


def _decode_rows(fb: ForwardBatch, lo: int, hi: int) -> ForwardBatch:
    """Rows [lo, hi) of an all-decode batch (row b's one token is token b) as a decode batch of their own."""
    return ForwardBatch(
        num_decode=hi - lo, input_ids=fb.input_ids[lo:hi], positions=fb.positions[lo:hi],
        out_cache_loc=fb.out_cache_loc[lo:hi], req_pool_indices=fb.req_pool_indices[lo:hi],
        seq_lens=fb.seq_lens[lo:hi], prefix_lens=fb.prefix_lens[lo:hi], extend_lens=fb.extend_lens[lo:hi],
        logits_indices=torch.arange(hi - lo, dtype=torch.int64, device=fb.logits_indices.device),
    )


def _empty_decode() -> ForwardBatch:
    """A decode batch of no requests: padded to a bucket it is all padding rows (used for capture)."""
    empty = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(0, empty, empty, empty, empty, (), (), (), empty)
