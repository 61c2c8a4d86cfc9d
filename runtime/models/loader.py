"""Weight loading: GGUF files and Hugging Face safetensors directories into one state dict.

Both paths produce `(ModelArch, {hf_param_name: tensor})` with Hugging Face parameter names
(`model.layers.0.self_attn.q_proj.weight`, ...), so models have one naming scheme.
GGUF: tensors are dequantized with the `gguf` package; llama.cpp stores Llama's Q/K rows permuted for its
interleaved rotary layout, which `_unpermute_qk` undoes so the rotate-half rotary of HF applies.
Under a --quantization mode other than none, weights chosen by runtime.models.quant_policy arrive as
kernels.quant.QTensor (codes + scales on the host; a GGUF's Q4/Q8 blocks keep their codes) instead of tensors;
the model packs them for its device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm

from kernels.quant import QTensor
from runtime import gguf_file
from runtime.models import quant_policy
from runtime.models.arch import GEMMA3_LOCAL_ROPE_THETA, ModelArch, gemma3_windows

Weight = torch.Tensor | QTensor
log = logging.getLogger(__name__)

_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms per layer differently (llama.cpp's ffn_norm is Gemma's pre-MLP norm)
_GGUF_GEMMA3_LAYER = {**_GGUF_LAYER, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def load_weights(
    path: str, dtype: torch.dtype, progress: bool = True, quantization: str = "none", group: int = 32
) -> tuple[ModelArch, dict[str, Weight]]:
    """Load a .gguf file or an HF model directory; tensors cast to `dtype` (norm weights kept float32),
    quantized weights as QTensor per runtime.models.quant_policy under `quantization` (a resolved mode:
    gguf/none/int8/int4/fp8)."""
    if path.endswith(".gguf"):
        return _load_gguf(path, dtype, progress, quantization, group)
    if os.path.isdir(path):
        return _load_safetensors_dir(path, dtype, progress, quantization, group)
    raise FileNotFoundError(f"model path {path!r} is neither a .gguf file nor a model directory")


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(torch.promote_types(dtype, torch.float32)) if "norm" in name else t.to(dtype)


# ------------------------------------------------------------------------------------------- GGUF
def gguf_arch(meta: dict[str, Any], names: set[str]) -> ModelArch:
    """The architecture from a GGUF's metadata (runtime/gguf_file.py `metadata`) and its tensor names."""

    def get(key: str, default=None):
        return meta.get(key, default)

    arch = get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (llama, qwen2, qwen3, gemma3)")
    heads = get(f"{arch}.attention.head_count")
    hidden = get(f"{arch}.embedding_length")
    vocab = get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    scaling = None
    if get(f"{arch}.rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": get(f"{arch}.rope.scaling.type"), "factor": get(f"{arch}.rope.scaling.factor", 1.0)}
    base = ModelArch(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=get(f"{arch}.feed_forward_length"),
        num_layers=get(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=get(f"{arch}.attention.head_count_kv", heads),
        head_dim=get(f"{arch}.attention.key_length") or hidden // heads,
        vocab_size=vocab,
        rms_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=get(f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=scaling,
    )
    return _gemma3_gguf(base, get) if arch == "gemma3" else base


def _gemma3_gguf(base: ModelArch, get) -> ModelArch:
    """Gemma 3 facts a GGUF does not store, as llama.cpp fixes them: the 1-in-6 sliding pattern, a local rotary
    base of 10000, sqrt(hidden) embedding scale, GeGLU, and the attention scale (head_dim^-1/2; the 27B model,
    62 layers, uses (hidden / heads)^-1/2). Norm weights in a Gemma GGUF already hold Gemma's (1 + w)."""
    window = int(get("gemma3.attention.sliding_window", 512))
    return dataclasses.replace(
        base,
        max_position=get("gemma3.context_length", 32768),
        layer_windows=gemma3_windows(base.num_layers, window),
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        post_norms=True,
        activation="gelu_tanh",
        embed_scale=base.hidden_size**0.5,
        query_pre_attn_scalar=base.hidden_size // base.num_heads if base.num_layers == 62 else base.head_dim,
        final_logit_softcap=get("gemma3.final_logit_softcapping"),
    )


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        part = (_GGUF_GEMMA3_LAYER if arch == "gemma3" else _GGUF_LAYER).get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    top = _GGUF_TOP.get(base)
    return None if top is None else f"{top}.{kind}"


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's permute: rows [h, pair, 2] (interleaved) -> [h, 2, pair] (HF rotate-half)."""
    out_dim = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(out_dim, *rest)


def _load_gguf(
    path: str, dtype: torch.dtype, progress: bool, mode: str, group: int
) -> tuple[ModelArch, dict[str, Weight]]:
    import gguf

    tensors = gguf_file.tensors(path)
    arch = gguf_arch(gguf_file.metadata(path), {t.name for t in tensors})
    weights: dict[str, Weight] = {}
    dense: dict[str, int] = {}  # GGUF block types of quantizable tensors the mode could not keep: dequantized
    for t in tqdm(tensors, desc="Loading GGUF", disable=not progress, unit="tensor"):
        name = gguf_to_hf_name(t.name, arch.arch)
        if name is None:
            continue
        kind = t.tensor_type.name
        shape = [int(x) for x in reversed(t.shape)]
        heads = _qk_heads(arch, name)
        q = quant_policy.gguf_tensor(name, t.data.reshape(shape[0], -1), kind, mode, group)
        if q is not None:
            weights[name] = q if heads is None else q.permute_rows(lambda a, h=heads: _unpermute_qk(a, h))
            continue
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise quant_policy.UnsupportedQuantization(
                f"GGUF tensor {t.name} has type {kind}, which radixgen cannot load") from e
        data = np.asarray(data, dtype=np.float32).reshape(shape)
        if mode != "none" and quant_policy.is_quantizable(name) and kind not in ("F32", "F16", "BF16"):
            dense[kind] = dense.get(kind, 0) + 1
        if heads is not None:
            data = _unpermute_qk(data, heads)
        w = quant_policy.dense_tensor(name, torch.from_numpy(np.array(data, copy=True)), mode, group)
        weights[name] = _cast(name, w, dtype) if isinstance(w, torch.Tensor) else w
    _tie_head(arch, weights, mode)
    mixed = _unmix_fused(weights, dtype)
    if mixed:
        log.info("%d fused q/k/v or gate/up groups mix block types (%s): dequantized on load", len(mixed),
                 "; ".join(sorted(set(mixed))))
    if dense:
        log.info("GGUF blocks without a kernel under --quantization %s, dequantized on load: %s", mode,
                 ", ".join(f"{n} x {k}" for k, n in sorted(dense.items())))
    return arch, weights


_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def _unmix_fused(weights: dict[str, Weight], dtype: torch.dtype) -> list[str]:
    """The model fuses q/k/v and gate/up into one weight each, which needs one form per group: a group whose
    parts mix dense tensors and kept blocks, or blocks of different kinds (a GGUF with Q5_0 q/k and Q8_0 v),
    becomes dense (the exact dequantized values, in `dtype`). Returns what each such group mixed."""
    mixed: list[str] = []
    layers = sorted({int(k.split(".")[2]) for k in weights if k.startswith("model.layers.")})
    for i in layers:
        for group in _FUSED:
            names = [f"model.layers.{i}.{part}.weight" for part in group]
            parts = [weights.get(n) for n in names]
            forms = {(p.kind, p.group) if isinstance(p, QTensor) else ("dense", 0) for p in parts}
            if len(forms) < 2 or any(p is None for p in parts):
                continue
            mixed.append(" + ".join(f[0] for f in sorted(forms)))
            for n, p in zip(names, parts, strict=True):
                if isinstance(p, QTensor):
                    weights[n] = p.dequantize().to(dtype)
    return mixed


def _qk_heads(arch: ModelArch, name: str) -> int | None:
    """Heads whose rows llama.cpp permuted in this tensor (Llama q/k weights and biases), else None."""
    if arch.arch != "llama":
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return arch.num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return arch.num_kv_heads
    return None


def _tie_head(arch: ModelArch, weights: dict[str, Weight], mode: str) -> None:
    """A tied model whose embedding is quantized, or whose head should be, gets an explicit lm_head."""
    if arch.tie_word_embeddings and quant_policy.LM_HEAD not in weights:
        head = quant_policy.tied_head(weights[quant_policy.EMBED], mode)
        if head is not None:
            weights[quant_policy.LM_HEAD] = head


# ------------------------------------------------------------------------------------- safetensors
def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def _iter_safetensors(files: list[str], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in tqdm(files, desc="Loading safetensors", disable=not progress, unit="shard"):
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, fh.get_tensor(key)


def _load_safetensors_dir(
    path: str, dtype: torch.dtype, progress: bool, mode: str, group: int
) -> tuple[ModelArch, dict[str, Weight]]:
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    qc = cfg.get("quantization_config")
    if qc and qc.get("quant_method") != "gguf":  # "gguf": transformers' mark on weights it dequantized (floats)
        raise quant_policy.UnsupportedQuantization(
            f"checkpoint is quantized with {qc.get('quant_method', qc)!r}, which radixgen cannot load "
            "(load its bf16/fp32 safetensors with --quantization int8|int4|fp8, or a GGUF)")
    arch = ModelArch.from_hf_config(cfg)
    weights: dict[str, Weight] = {}
    for k, v in _iter_safetensors(_safetensors_files(path), progress):
        q = quant_policy.dense_tensor(k, v, mode, group)
        weights[k] = _cast(k, q, dtype) if isinstance(q, torch.Tensor) else q
        if arch.arch == "gemma3" and k.endswith("norm.weight"):  # Gemma's RMSNorm scales by (1 + w)
            weights[k] = cast(torch.Tensor, weights[k]) + 1.0
    _tie_head(arch, weights, mode)
    return arch, weights


_GGUF_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}


def read_model_type(path: str) -> tuple[str | None, list[str] | None]:
    """(model_type, architectures) as Hugging Face names them: config.json's fields, or for a GGUF file its
    `general.architecture` and the matching HF class name (None where the file does not say)."""
    if path.endswith(".gguf"):
        arch = gguf_file.metadata(path).get("general.architecture")
        return arch, ([_GGUF_HF_ARCH[arch]] if arch in _GGUF_HF_ARCH else None)
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        return None, None
    with open(file) as fh:
        cfg = json.load(fh)
    return cfg.get("model_type"), cfg.get("architectures")


def read_eos_ids(path: str) -> frozenset[int]:
    """EOS ids the model declares: GGUF metadata, or config.json joined with generation_config.json."""
    ids: set[int] = set()
    if path.endswith(".gguf"):
        eos = gguf_file.metadata(path).get("tokenizer.ggml.eos_token_id")
        if eos is not None:
            ids.add(int(eos))
        return frozenset(ids)
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as fh:
                eos = json.load(fh).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
