"""ModelArch: the shape facts of a decoder-only transformer, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelArch:
    arch: str  # "llama" (also SmolLM, Mistral), "qwen2", "qwen3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    rope_scaling: dict | None = field(default=None, hash=False)

    @staticmethod
    def from_hf_config(cfg: dict) -> ModelArch:
        model_type = cfg.get("model_type", "llama")
        arch = {"qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type, "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2, qwen3)")
        heads = cfg["num_attention_heads"]
        return ModelArch(
            arch=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            rope_scaling=_rope_scaling(cfg),
        )


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    return None if kind in (None, "default") else dict(scaling)
