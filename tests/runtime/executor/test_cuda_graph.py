"""CUDA-graph decode runner, GPU memory sizing and the sync-free sampler paths.

CPU tier: bucket choice and padding arithmetic, the KV sizing rule, and the whole graph runner on SmolLM2
with an eager stand-in for the graph (it re-runs the captured function, reading the same static buffers),
so padding rows, the pad slot and the output views are checked without a GPU. The GPU tier (marked `gpu`)
captures real graphs and compares greedy outputs with graphs on and off.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from runtime.executor.cuda_graph import CudaGraphRunner, bucket_for, capture_buckets, pad_decode_metadata
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.greedy import OfflineBatch, greedy_generate
from runtime.executor.memory import KVPool, gpu_kv_slots

GiB = 1 << 30


class EagerGraph:
    """Stand-in for torch.cuda.CUDAGraph: replay re-runs the captured function into the same output."""

    def __init__(self) -> None:
        self.fn: Callable[..., torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.fn, self.args, self.out = fn, args, fn(*args)
        return self.out

    def replay(self) -> torch.Tensor:
        self.out.copy_(self.fn(*self.args))
        return self.out


def test_capture_buckets_and_bucket_choice() -> None:
    assert capture_buckets(1) == (1,)
    assert capture_buckets(5) == (1, 2, 4, 5)
    b = capture_buckets(160)
    assert b[-1] == 160 and 128 in b and list(b) == sorted(set(b))
    assert [bucket_for(b, n) for n in (1, 3, 4, 13, 160)] == [1, 4, 4, 16, 160]
    assert bucket_for(b, 161) is None
    with pytest.raises(ValueError):
        capture_buckets(0)


def test_pad_decode_metadata_pads_into_the_pad_slot() -> None:
    fb = ForwardBatch.build([[11], [12], [13]], [4, 9, 2], torch.tensor([40, 41, 42]), [5, 6, 7], num_decode=3)
    m = pad_decode_metadata(fb, 4, pad_slot=999)
    assert m[:, :3].tolist() == [[11, 12, 13], [4, 9, 2], [40, 41, 42], [5, 6, 7], [5, 10, 3], [4, 9, 2]]
    assert m[:, 3].tolist() == [0, 0, 999, 0, 1, 0]  # token 0 at position 0, seq_len 1, slot = pad slot


def test_kv_pool_has_one_unowned_pad_slot() -> None:
    pool = KVPool(2, 10, 3, 8, torch.float32)
    assert pool.k_cache.shape == (2, 11, 3, 8) and pool.num_slots == 10 and pool.pad_slot == 10


def test_gpu_kv_slots_follows_mem_fraction_of_total() -> None:
    per_slot = 2 * 30 * 3 * 64 * 2  # SmolLM2 in bf16: 23040 bytes
    # 80 GiB card, 10 GiB used after the weights: weights + KV may hold 0.85 * 80 = 68 GiB, so KV gets 58.
    n = gpu_kv_slots(80 * GiB, 70 * GiB, 0.85, per_slot)
    assert n == (70 * GiB - int(80 * GiB * 0.15)) // per_slot
    assert abs(n * per_slot - 58 * GiB) < per_slot
    assert gpu_kv_slots(80 * GiB, 70 * GiB, 0.85, per_slot, page_size=16) % 16 == 0
    assert gpu_kv_slots(80 * GiB, 70 * GiB, 0.5, per_slot) < n  # a smaller fraction leaves more free
    with pytest.raises(ValueError, match="mem-fraction-static or set --max-total-tokens"):
        gpu_kv_slots(80 * GiB, 10 * GiB, 0.85, per_slot)  # 70 GiB in use: over the 68 GiB budget
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        gpu_kv_slots(80 * GiB, 70 * GiB, 1.5, per_slot)


def test_req_to_token_mirror_flushes_queued_writes_at_once() -> None:
    """The CUDA layout (a host mirror plus a device table) exercised on CPU with two separate tensors."""
    from runtime.executor.memory import ReqToTokenTable

    t = ReqToTokenTable(4, 16)
    t.host = t.table.clone()  # what a CUDA table looks like: two tensors
    t.write(1, 0, torch.tensor([5, 6, 7]))
    t.write(2, 3, torch.tensor([9]))
    t.write(1, 3, torch.tensor([8]))
    t.write_cells([0, 2, 1], [2, 4, 4], torch.tensor([11, 12, 13]))  # a decode step: one cell per row
    assert t.read(1, 0, 5).tolist() == [5, 6, 7, 8, 13] and int(t.table.sum()) == 0  # nothing sent yet
    assert t.read(0, 2, 3).tolist() == [11] and t.read(2, 3, 5).tolist() == [9, 12]
    t.flush()
    assert torch.equal(t.table, t.host) and t.table[2, 3] == 9 and not t._pending and not t._pending_cells
    t.flush()  # nothing queued: no-op
    assert torch.equal(t.table, t.host)


@pytest.fixture
def graphed(smollm_runner):
    """The shared SmolLM2 runner with an eager-stand-in graph runner for batch sizes 1, 2, 4 (removed after)."""
    r = smollm_runner
    gr = CudaGraphRunner(r.model, r.attn, r.req_to_token.table, r.pool.pad_slot, 4, graph_factory=EagerGraph)
    gr.capture()
    yield r, gr
    r.graph_runner = None


PROMPTS = [[1, 504, 3458, 314, 260, 1345, 28, 3148, 30], [1, 2022, 4462], [1, 378, 2113, 5203, 9066, 13, 216]]


def test_graph_runner_decode_equals_eager_and_touches_only_its_slots(graphed) -> None:
    r, gr = graphed
    batch = OfflineBatch(r, PROMPTS)
    try:
        batch.extend(PROMPTS)
        nxt = [[7], [8], [9]]
        slots = r.allocator.alloc(3)
        batch.owned.append(slots)
        for b in range(3):
            r.req_to_token.write(batch.rows[b], batch.lens[b], slots[b : b + 1])
        fb = ForwardBatch.build(nxt, list(batch.lens), slots, batch.rows, num_decode=len(nxt))
        eager = r.forward(fb).clone()
        k_before = r.pool.k_cache.clone()
        r.graph_runner = gr
        got = r.forward(fb)  # bs 3 replays bucket 4: one padding row
        assert gr.replays == 1 and got.shape == eager.shape
        torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        changed = (r.pool.k_cache != k_before).flatten(2).any(-1).any(0)  # [S + 1] slot written by the replay
        allowed = torch.zeros_like(changed)
        allowed[slots] = True
        allowed[r.pool.pad_slot] = True
        assert not (changed & ~allowed).any(), "the replay wrote a slot it does not own"
    finally:
        r.graph_runner = None
        batch.release()


def test_greedy_generation_with_graphs_equals_eager(graphed) -> None:
    r, gr = graphed
    want = greedy_generate(r, PROMPTS, 10)
    r.graph_runner = gr
    got = greedy_generate(r, PROMPTS, 10)
    assert gr.replays == 9  # every decode step (bs 3 -> bucket 4) went through the graph
    assert got == want
    single = greedy_generate(r, PROMPTS[:1], 6)  # bucket 1, exact fit
    r.graph_runner = None
    assert single == greedy_generate(r, PROMPTS[:1], 6)


def test_graph_runner_declines_what_it_cannot_replay(graphed) -> None:
    _, gr = graphed
    prefill = ForwardBatch.build([[1, 2, 3]], [0], torch.tensor([0, 1, 2]), [0])
    big = ForwardBatch.build([[1]] * 5, [3] * 5, torch.arange(5), list(range(5)), num_decode=5)
    small = ForwardBatch.build([[1]] * 2, [3] * 2, torch.arange(2), [0, 1], num_decode=2)
    assert not gr.can_run(prefill) and not gr.can_run(big) and gr.can_run(small)


def test_sort_threshold_equals_radix_select() -> None:
    """The CUDA top-p path (a sort, no host sync) keeps exactly the tokens the CPU radix select keeps."""
    from runtime.sampling.sampler import _radix_threshold, _sort_threshold

    g = torch.Generator().manual_seed(3)
    for scale in (0.3, 1.0, 4.0):
        probs = torch.softmax(torch.randn(4, 3000, generator=g) * scale, dim=-1)
        probs[1, :50] = 0.0
        probs[2, 10:20] = probs[2, 5]  # a tie group
        for top_p in (0.01, 0.3, 0.9, 0.999):  # the sampler applies top-p only below 1
            target = top_p * probs.sum(-1)
            a, b = _sort_threshold(probs, target), _radix_threshold(probs, probs, target)
            assert torch.equal(probs >= a[:, None], probs >= b[:, None]), (scale, top_p)
    tied = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1] + [0.0] * 300])
    th = _sort_threshold(tied, torch.tensor([0.35]))  # 0.3 before the second 0.3: both 0.3s kept
    assert (tied[0] >= th[0]).tolist()[:5] == [False, True, True, False, False]


# ------------------------------------------------------------------------------------------ GPU tier


def _cuda_greedy(backend: str, dtype: str, disable_graph: bool, prompts: list[list[int]]) -> tuple[list, int]:
    from runtime.config import make_config
    from runtime.executor.model_runner import create_model_runner

    cfg = make_config(device="cuda", dtype=dtype, attention_backend=backend, disable_cuda_graph=disable_graph,
                      max_total_tokens=65536, max_running_requests=16, cuda_graph_max_bs=16)
    runner = create_model_runner(cfg, progress=False)
    try:
        outs = greedy_generate(runner, prompts, 32)
        return outs, runner.graph_runner.replays if runner.graph_runner is not None else 0
    finally:
        del runner
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,dtype,bs", [("triton", "bfloat16", 8), ("flashinfer", "bfloat16", 8),
                                              ("triton", "float32", 11)])
def test_cuda_graph_greedy_equals_eager(backend: str, dtype: str, bs: int) -> None:
    """Same kernels replayed: identical greedy tokens (bs 8 is a bucket; 11 replays bucket 12 with padding)."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (20 + 7 * i,), generator=g).tolist() for i in range(bs)]
    eager, n0 = _cuda_greedy(backend, dtype, True, prompts)
    graphed, n1 = _cuda_greedy(backend, dtype, False, prompts)
    assert n0 == 0 and n1 == 31  # every decode step replayed a graph
    assert graphed == eager
