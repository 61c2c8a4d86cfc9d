"""Tiny random checkpoints of each supported architecture, saved by transformers, for tests."""

from __future__ import annotations

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_checkpoint(tmp_path, kind: str) -> str:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama3-scaled":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        cfg = tf.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY, tie_word_embeddings=True))
    elif kind == "gemma3":
        model = tf.Gemma3ForCausalLM(tiny_gemma3_config())
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False))
    with torch.no_grad():  # random norms so a wrong norm placement shows up (Gemma's scale by 1 + w)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if kind == "gemma3" else p.uniform_(0.5, 1.5)
    path = str(tmp_path / kind)
    model.save_pretrained(path)
    return path


GEMMA3_WINDOW = 5  # tiny Gemma 3: prompts of ~20 tokens cross the window several times


def tiny_gemma3_config():
    """Sliding, full, sliding layers (window 5), a linear-scaled global rotary, an attention scale other than
    head_dim's and a final logit soft-cap: every Gemma 3 field the loader reads differs from its default."""
    import transformers as tf

    tiny = {**TINY, "num_hidden_layers": 3, "num_key_value_heads": 1}
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return tf.Gemma3TextConfig(**tiny, head_dim=32, sliding_window=GEMMA3_WINDOW, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               rope_parameters=rope, final_logit_softcapping=30.0, tie_word_embeddings=True)
