"""The Llama family (SmolLM2, Llama 2/3, Mistral), Qwen2 (qkv bias) and Qwen3 (q/k norm) in one forward.

Data flow: ForwardBatch (new tokens of B requests, flattened to T) -> embeddings [T, H] -> 30x (RMSNorm,
fused QKV projection, rotary, attention through the kernels seam which also stores K/V into the pool,
output projection, RMSNorm, fused gate/up SiLU MLP) -> final norm on the rows in `logits_indices` only
-> logits [K, vocab] float32. Weights are plain tensors (no nn.Module) in Hugging Face naming order.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import ref
from kernels.api import BaseAttnBackend
from runtime.executor.forward_batch import ForwardBatch
from runtime.models.arch import ModelArch


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor  # [H] float32
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    b_qkv: torch.Tensor | None  # [(Hq + 2 Hkv) * D] (Qwen2)
    w_o: torch.Tensor  # [H, Hq * D]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    ln_mlp: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor  # [H, I]


def elementwise_kernels(device: str | torch.device) -> tuple[Callable, Callable]:
    """(rmsnorm, apply_rope): the fused Triton kernels on CUDA when triton is importable (one launch each
    instead of ~6 torch ops), else the torch reference. Both pairs have kernels.ref's signatures."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None:
        from kernels.triton.rmsnorm import rmsnorm
        from kernels.triton.rope import apply_rope

        return rmsnorm, apply_rope
    return ref.rmsnorm, ref.apply_rope


class LlamaForCausalLM:
    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> None:
        self.arch = arch
        w = {k: v.to(device) for k, v in weights.items()}
        self.embed = w.pop("model.embed_tokens.weight")  # [V, H]
        self.norm = w.pop("model.norm.weight")
        self.lm_head = self.embed if arch.tie_word_embeddings else w.pop("lm_head.weight")
        self.layers = [self._layer(w, i) for i in range(arch.num_layers)]
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.cos_sin = ref.rope_cos_sin(arch.head_dim, arch.max_position, arch.rope_theta, arch.rope_scaling, device)
        self.rmsnorm, self.apply_rope = elementwise_kernels(device)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv = [w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        bias = None
        if self.arch.attention_bias:
            bias = torch.cat([w.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        qk_norm = self.arch.qk_norm
        return LayerWeights(
            ln_attn=w.pop(p + "input_layernorm.weight"),
            w_qkv=torch.cat(qkv, dim=0).contiguous(),
            b_qkv=bias,
            w_o=w.pop(p + "self_attn.o_proj.weight"),
            q_norm=w.pop(p + "self_attn.q_norm.weight") if qk_norm else None,
            k_norm=w.pop(p + "self_attn.k_norm.weight") if qk_norm else None,
            ln_mlp=w.pop(p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")]).contiguous(),
            w_down=w.pop(p + "mlp.down_proj.weight"),
        )

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, attn: BaseAttnBackend) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab] float32. attn.init_forward must have been called for fb."""
        a = self.arch
        h = self.embed[fb.input_ids]  # [T, H]
        residual: torch.Tensor | None = None
        t = h.shape[0]
        for i, lw in enumerate(self.layers):
            x, residual = self.rmsnorm(h, lw.ln_attn, a.rms_eps, residual)
            qkv = F.linear(x, lw.w_qkv, lw.b_qkv)  # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, a.num_heads, a.head_dim)
            k = k.view(t, a.num_kv_heads, a.head_dim)
            v = v.view(t, a.num_kv_heads, a.head_dim)
            if lw.q_norm is not None:
                q = self.rmsnorm(q, lw.q_norm, a.rms_eps)[0]
                k = self.rmsnorm(k, lw.k_norm, a.rms_eps)[0]
            q, k = self.apply_rope(q, k, fb.positions, self.cos_sin)
            o = attn.forward(q, k, v, i)  # [T, Hq, D]
            h = F.linear(o.reshape(t, self.q_size), lw.w_o)
            x, residual = self.rmsnorm(h, lw.ln_mlp, a.rms_eps, residual)
            gate, up = F.linear(x, lw.w_gate_up).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, lw.w_down)
        last = (h + residual)[fb.logits_indices]
        x = self.rmsnorm(last, self.norm, a.rms_eps)[0]
        logits = F.linear(x, self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()
