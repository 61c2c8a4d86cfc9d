"""Shared fixtures: the default model path, one SmolLM2 model runner per test session, and the session's real
servers.

Modules that need a real server with common flags share one per test session (`default_server`,
`float32_server`), whichever directory they are in: a start loads the model, which costs more than most
modules' tests. A module whose tests change the server's state for good (kill it, fill it, change its flags)
starts its own.
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Inductor compiles of SmolLM2 take minutes on 2 cores: the suite runs eagerly (servers it starts inherit
# this), and the tests of the compiled path (tests/runtime/executor/test_compiled.py) build their own compiled runners.
os.environ.setdefault("RADIXGEN_DISABLE_COMPILE", "1")


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from runtime.models.registry import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path):
    """radixgen's tokenizer of the default model, one per session. Shared: a test must not change it."""
    from runtime.tokenizer.load import load_tokenizer

    return load_tokenizer(smollm_path)


@pytest.fixture(scope="session")
def smollm_runner(smollm_path):
    """A float32 SmolLM2 runner with a small KV pool (tests that need others build their own)."""
    from runtime.config import make_config
    from runtime.executor.model_runner import create_model_runner

    return create_model_runner(make_config(model_path=smollm_path, dtype="float32", max_total_tokens=8192),
                               progress=False)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    """transformers' tokenizer of the default model's GGUF file (its GGUF conversion takes seconds: one per
    session). Shared: a test must not change it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


@pytest.fixture(scope="session")
def hf_smollm(smollm_path, hf_smollm_tokenizer):
    """transformers' own loading of the same GGUF file (float32) and its tokenizer. Shared: a test must not
    change either."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.dirname(smollm_path), os.path.basename(smollm_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
    return model, hf_smollm_tokenizer


def _shared(*args: str):  # noqa: ANN202
    from tests.server.harness import ServerProc

    s = ServerProc(*args)
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


@pytest.fixture(scope="session")
def default_server():
    """The default model and flags, a small KV pool, and a generous grammar compile limit (many schemas compile
    at once on a shared CPU; the limit itself is tested with the grammar backend)."""
    yield from _shared("--max-total-tokens", "8192", "--grammar-compile-timeout", "120", "--log-level", "warning")


@pytest.fixture(scope="session")
def float32_server():
    """As `default_server` in float32: tests that compare a cached and an uncached computation exactly (in bf16
    a different matmul shape rounds differently)."""
    yield from _shared("--max-total-tokens", "8192", "--grammar-compile-timeout", "120", "--log-level", "warning",
                       "--dtype", "float32")
