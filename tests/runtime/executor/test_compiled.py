"""The compiled CPU decode path (runtime/executor/compiled.py): torch.compile'd graphs per bucket vs eager.

These are the suite's only inductor compiles (tests/conftest.py sets RADIXGEN_DISABLE_COMPILE=1 for the rest):
a tiny random Llama compiled once per module for buckets 1..32, and one SmolLM2 bucket (bs 1) in bf16.
Tolerances: fp32 compiled vs eager logits within 1e-4 (inductor reorders float32 sums); bf16 (tiny model)
within 0.05 + 2 % on logits of magnitude ~1; bf16 SmolLM2 no further from float32 than eager bf16
(25 % slack), same argmax.
"""

from __future__ import annotations

import logging

import pytest
import torch

from runtime.config import cpu_has_native_bf16, make_config
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.greedy import OfflineBatch, greedy_generate
from runtime.executor.model_runner import create_model_runner
from tests.runtime.models.tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def _runner(path: str, dtype: str, compiled: bool, max_bs: int = 32, mode: str = "jit"):
    """compiled: the in-process torch.compile path (--compile-mode jit) unless `mode` says otherwise."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIXGEN_DISABLE_COMPILE", "0")
    try:
        cfg = make_config(model_path=path, dtype=dtype, max_total_tokens=8192, max_running_requests=40,
                          compile_mode=mode if compiled else "off", compile_max_bs=max_bs,
                          quantization="none")  # dense
        return create_model_runner(cfg, progress=False)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def fp32_pair(tiny_path):
    compiled = _runner(tiny_path, "float32", True)
    assert compiled.graph_runner is not None and compiled.graph_runner.buckets == (1, 2, 4, 8, 16, 32)
    return _runner(tiny_path, "float32", False), compiled


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _decode_logits(runner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    batch = OfflineBatch(runner, prompts)
    try:
        logits = batch.extend(prompts)
        out = []
        for _ in range(steps):
            logits = batch.extend([[int(t)] for t in logits.argmax(-1)], is_decode=True).clone()
            out.append(logits)
        return out
    finally:
        batch.release()


@pytest.mark.parametrize("bs", [1, 3, 8, 32])
def test_fp32_compiled_greedy_identical_over_64_steps(fp32_pair, bs):
    eager, compiled = fp32_pair
    prompts = _prompts(bs, seed=bs)
    before = compiled.graph_runner.replays
    assert greedy_generate(compiled, prompts, 64) == greedy_generate(eager, prompts, 64)
    assert compiled.graph_runner.replays - before == 63  # every decode step went through a compiled graph


def test_decode_batch_above_the_largest_bucket_replays_it_in_chunks(fp32_pair):
    """37 rows over buckets up to 32: each decode step replays bucket 32, then bucket 8 (5 rows + 3 padding)."""
    eager, compiled = fp32_pair
    prompts = _prompts(37, seed=11)
    before = compiled.graph_runner.replays
    assert greedy_generate(compiled, prompts, 12) == greedy_generate(eager, prompts, 12)
    assert compiled.graph_runner.replays - before == 2 * 11
    for a, b in zip(_decode_logits(eager, prompts, 2), _decode_logits(compiled, prompts, 2), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_fp32_compiled_logits_close_to_eager(fp32_pair):
    eager, compiled = fp32_pair
    prompts = _prompts(5, seed=7)  # bucket 8: three padding rows
    for a, b in zip(_decode_logits(eager, prompts, 4), _decode_logits(compiled, prompts, 4), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_bucket_boundary_crossing_mid_generation(fp32_pair):
    """Requests finish at different steps: the decode batch shrinks 5 -> 3 -> 2 -> 1 (buckets 8, 4, 2, 1)."""
    stops = [4, 9, 9, 14, 20]
    outs = []
    for runner in fp32_pair:
        prompts = _prompts(5, seed=3)
        batch = OfflineBatch(runner, prompts)
        try:
            tokens = [[int(t)] for t in batch.extend(prompts).argmax(-1)]
            for step in range(1, max(stops)):
                live = [b for b in range(5) if step < stops[b]]
                slots = runner.allocator.alloc(len(live))
                batch.owned.append(slots)
                for j, b in enumerate(live):
                    runner.req_to_token.write(batch.rows[b], batch.lens[b], slots[j : j + 1])
                fb = ForwardBatch.build([tokens[b][-1:] for b in live], [batch.lens[b] for b in live], slots,
                                        [batch.rows[b] for b in live], num_decode=len(live))
                nxt = runner.forward(fb).argmax(-1).tolist()
                for j, b in enumerate(live):
                    batch.lens[b] += 1
                    tokens[b].append(nxt[j])
        finally:
            batch.release()
        outs.append(tokens)
    assert outs[0] == outs[1] and [len(t) for t in outs[0]] == stops


def test_bf16_compiled_logits_close_to_bf16_eager(tiny_path):
    eager, compiled = _runner(tiny_path, "bfloat16", False), _runner(tiny_path, "bfloat16", True, max_bs=4)
    assert compiled.graph_runner is not None and set(compiled.graph_runner.graphs) == {1, 2, 4}
    prompts = _prompts(3, seed=5)
    for a, b in zip(_decode_logits(eager, prompts, 3), _decode_logits(compiled, prompts, 3), strict=True):
        torch.testing.assert_close(b, a, atol=5e-2, rtol=2e-2)


def test_compile_failure_warns_once_and_serves_eagerly(tiny_path, monkeypatch, caplog):
    from runtime.executor import compiled as compiled_mod

    def boom(self, fn, args):
        raise RuntimeError("forced inductor failure\nsecond line")

    monkeypatch.setattr(compiled_mod.CompiledGraph, "capture", boom)
    with caplog.at_level(logging.WARNING, logger="runtime.executor.compiled"):
        runner = _runner(tiny_path, "float32", True, max_bs=4)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: forced inductor failure" in warnings[0].getMessage()
    assert runner.graph_runner is None
    eager = _runner(tiny_path, "float32", False)
    prompts = _prompts(2, seed=9)
    assert greedy_generate(runner, prompts, 8) == greedy_generate(eager, prompts, 8)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 is not the default dtype on a CPU without native bf16 "
                    "(torch emulates it there: ~45 s for this test); the tiny model's bf16 buckets still run")
def test_smollm2_bf16_compiled_bucket_close_to_eager(smollm_path):
    """One real-model bucket (bs 1) in bf16, the default dtype on CPUs with native bf16, judged against float32.

    bf16 forwards drift from float32 over 30 layers by where they round: the compiled graph (inductor fusing
    kernels.ref's row ops) keeps fused intermediates in float32, the eager reference ops round each op's result
    to bf16, the eager native row ops (kernels/cpu/elementwise.cpp) round once per fused op. None is the
    reference, and which of them lands closer differs from step to step (per-step mean errors of 0.04-0.46 seen
    for each). The stated tolerances, over 2 prompts x 4 decode steps together: the compiled bucket is no further
    from the float32 logits than eager bf16 over the same reference ops (mean and max, 25 % slack), the native
    eager ops are no further than the reference ops either, and all pick the same greedy token at every step.
    """
    from runtime.models.llama import REF_ELEMENTWISE

    native, compiled = _runner(smollm_path, "bfloat16", False), _runner(smollm_path, "bfloat16", True, max_bs=1)
    ref_ops = _runner(smollm_path, "bfloat16", False)
    ref_ops.model.ew = REF_ELEMENTWISE  # the op graph inductor traces, run eagerly
    ref = _runner(smollm_path, "float32", False)
    assert compiled.graph_runner is not None and set(compiled.graph_runner.graphs) == {1}
    before = compiled.graph_runner.replays
    runners = {"ref_ops": ref_ops, "compiled": compiled, "native": native, "fp32": ref}
    logits = {k: [] for k in runners}
    for prompt in ([1, 504, 3458, 314, 260, 1345, 28, 3148, 30], [1, 2022, 4462, 253, 7355, 30]):
        for k, r in runners.items():
            logits[k] += _decode_logits(r, [prompt], 4)  # bucket 1: one prompt at a time
    err = {k: torch.cat([(a - b).abs() for a, b in zip(v, logits["fp32"], strict=True)]) for k, v in logits.items()}
    for k in ("compiled", "native"):
        assert err[k].mean().item() <= 1.25 * err["ref_ops"].mean().item() + 0.02, (k, err[k].mean(), err["ref_ops"].mean())
        assert err[k].max().item() <= 1.25 * err["ref_ops"].max().item() + 0.125, (k, err[k].max(), err["ref_ops"].max())
    for k in ("ref_ops", "compiled", "native"):
        assert [x.argmax(-1).tolist() for x in logits[k]] == [x.argmax(-1).tolist() for x in logits["fp32"]], k
    assert compiled.graph_runner.replays - before == 2 * 4  # every decode step of both prompts was compiled


def test_auto_dtype_is_bf16_only_on_cpus_with_native_bf16(tmp_path, monkeypatch):
    from runtime import config

    plain, amx = tmp_path / "plain", tmp_path / "amx"
    plain.write_text("flags\t: fpu sse avx2 avx512f\n")
    amx.write_text("flags\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert not config.cpu_has_native_bf16(str(plain)) and config.cpu_has_native_bf16(str(amx))
    assert not config.cpu_has_native_bf16(str(tmp_path / "missing"))
    for has, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(config, "cpu_has_native_bf16", lambda has=has: has)
        dense = config.resolve(config.make_config(device="cpu", quantization="none"))
        assert dense.model.dtype == want
        assert config.resolve(config.make_config(device="cpu", dtype="float32")).model.dtype == "float32"
        # the default GGUF keeps its quantized blocks either way (their kernels take bf16 activations on any CPU);
        # the model's dtype, and its dense copies', follow the CPU
        default = config.resolve(config.make_config(device="cpu")).model
        assert default.dtype == want and default.quantization == "gguf"
