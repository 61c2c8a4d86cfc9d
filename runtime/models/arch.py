"""ModelArch: the shape facts of a decoder-only transformer, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelArch:
    arch: str  # "llama" (also SmolLM, Mistral), "qwen2", "qwen3", "gemma3"
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
    rope_scaling: dict | None = field(default=None, hash=False)  # full-attention layers' rotary scaling
    # Gemma 3: sliding-window layers, their own rotary base, output norms, GeGLU and scaled embeddings
    layer_windows: tuple[int, ...] = ()  # per layer: attention window in tokens (0: full attention); () all full
    rope_local_theta: float | None = None  # rotary base of the sliding-window layers (None: rope_theta)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs; pre-MLP norm "pre_feedforward_layernorm"
    activation: str = "silu"  # MLP gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) when set

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """Attention window of `layer` in tokens: a query at position p sees keys in (p - window, p]; 0: all."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_window(self) -> int:
        """The largest window of any sliding-window layer (0: every layer attends to the whole sequence)."""
        return max(self.layer_windows, default=0)

    @staticmethod
    def from_hf_config(cfg: dict) -> ModelArch:
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3_text":
            return _gemma3_from_hf(cfg)
        arch = {"qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type, "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2, qwen3, gemma3_text)")
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


GEMMA3_SLIDING_PATTERN = 6  # Gemma 3: every 6th layer attends globally, the others through the window
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def gemma3_windows(num_layers: int, window: int, layer_types: list[str] | None = None) -> tuple[int, ...]:
    """Per-layer windows: `layer_types` ("sliding_attention" / "full_attention") when the config lists them,
    else Gemma 3's pattern (layer i is global when (i + 1) % 6 == 0)."""
    if layer_types is None:
        layer_types = ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must list sliding_attention/full_attention for {num_layers} layers")
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


def _gemma3_from_hf(cfg: dict) -> ModelArch:
    """A Hugging Face `gemma3_text` config (Gemma3ForCausalLM). Rotary: `rope_parameters` keyed by layer type
    (transformers 5) or rope_theta / rope_local_base_freq / rope_scaling (older configs)."""
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attn_logit_softcapping is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma 3 activation {act!r} (gelu_pytorch_tanh)")
    rp = cfg.get("rope_parameters") or {}
    full = dict(rp.get("full_attention") or cfg.get("rope_scaling") or {})
    local = dict(rp.get("sliding_attention") or {})
    theta = float(full.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)))
    if local.get("rope_type", "default") != "default":
        raise ValueError("rotary scaling on Gemma 3's sliding-window layers is not supported")
    heads = cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    hidden = cfg["hidden_size"]
    return ModelArch(
        arch="gemma3",
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=cfg["vocab_size"],
        rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        rope_scaling=None if full.get("rope_type", "default") == "default" else full,
        layer_windows=gemma3_windows(layers, int(cfg.get("sliding_window") or 512), cfg.get("layer_types")),
        rope_local_theta=local_theta,
        post_norms=True,
        activation="gelu_tanh",
        embed_scale=hidden**0.5,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
    )
