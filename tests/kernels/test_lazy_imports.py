"""`import kernels` / `import runtime` never import triton or flashinfer; the FlashInfer CSR builder is exact."""

from __future__ import annotations

import subprocess
import sys

import torch

from kernels.flashinfer_backend import build_kv_indices
from tests.kernels.paged import make_paged_batch


def test_import_kernels_and_runtime_skips_triton_and_flashinfer() -> None:
    code = (
        "import kernels, kernels.api, kernels.ref, kernels.torch_backend, kernels.flashinfer_backend, runtime, sys;"
        "import runtime.executor.model_runner;"
        "bad = [m for m in ('triton', 'flashinfer') if m in sys.modules];"
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_build_kv_indices_concatenates_each_requests_slots() -> None:
    pb = make_paged_batch([3, 0, 17], [1, 5, 16], 1, 16, page_size=16, seed=2)
    indptr, indices = build_kv_indices(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32
    assert indptr.tolist() == [0, 4, 9, 42]
    want = torch.cat([pb.req_to_token[r, :s] for r, s in zip(pb.req_pool_indices.tolist(), pb.seq_lens, strict=True)])
    assert torch.equal(indices, want)


def test_build_kv_indices_empty_batch() -> None:
    r2t = torch.zeros((2, 8), dtype=torch.int32)
    indptr, indices = build_kv_indices(r2t, torch.zeros(0, dtype=torch.int64), ())
    assert indptr.tolist() == [0] and indices.numel() == 0
