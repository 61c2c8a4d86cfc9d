"""The Llama family (SmolLM2, Llama 2/3, Mistral), Qwen2 (qkv bias), Qwen3 (q/k norm) and Gemma 3 in one forward.

Data flow: token ids [T] -> embeddings [T, H] -> N x (add+RMSNorm, fused QKV projection, rotary, attention
through the kernels seam which also stores K/V into the pool, output projection, add+RMSNorm, fused
gate/up SiLU MLP) -> final norm on the rows in `logits_indices` only -> logits [K, vocab] float32.
Gemma 3 adds, from ModelArch's fields: embeddings scaled by sqrt(H); RMSNorm on the attention output and on the
MLP output before each residual add (its norm weights hold (1 + w), so the same RMSNorm applies); GeGLU (tanh);
a second rotary table for its sliding-window layers (whose window the attention backend applies, see
kernels/sliding_window.py); an optional final logit soft-cap.

Weights are frozen `nn.Parameter`s (requires_grad=False) so that torch.compile with inductor freezing
(runtime/executor/compiled.py) treats them as constants and prepacks every linear for oneDNN. The rotary
cos/sin rows are gathered once per forward, not per layer. Attention is called through `attend(q, k, v,
layer_id)`: the backend's own `forward` when eager, the opaque custom op `radixgen_rt::attention`
(runtime/models/attn_op.py) when compiled, so the graph never traces into a backend.
Quantized weights (kernels.quant.QTensor from the loader) are packed here once for the device into QuantWeight
submodules (their tensors are buffers) and called through `quant.linear` / `quant.embedding`, which take dense
weights too; torch's CPU weight-only ops trace under torch.compile as ATen ops.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple, cast, overload

import torch
from torch import nn

from kernels import fallbacks, quant, ref
from kernels.api import BaseAttnBackend
from runtime.executor.forward_batch import ForwardBatch
from runtime.models.arch import ModelArch

log = logging.getLogger(__name__)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]  # (q, k, v, layer) -> o


class Elementwise(NamedTuple):
    """The forward's fused row ops, all with kernels.ref's signatures."""

    rmsnorm: Callable  # (x, weight, eps, residual) -> (normed, x + residual)
    apply_rope: Callable  # (q, k, positions, cos_sin) -> (q, k), gathering cos/sin rows itself
    silu_mul: Callable  # gate_up [T, 2I] -> silu(gate) * up [T, I]

    @property
    def fused_rope(self) -> bool:
        """False for the reference, whose rope the model feeds pre-gathered cos/sin (rope_gathered)."""
        return self.apply_rope is not ref.apply_rope


REF_ELEMENTWISE = Elementwise(ref.rmsnorm, ref.apply_rope, ref.silu_mul)  # what torch.compile traces and fuses


def elementwise_kernels(device: str | torch.device, dtype: torch.dtype | None = None) -> Elementwise:
    """The eager forward's row ops: fused Triton kernels on CUDA when triton is importable, the native CPU
    kernels (kernels/cpu/elementwise.cpp) on a CPU for float32/bfloat16 when the extension builds here (one
    warning and the torch reference when it does not), else the torch reference (one op chain of ~6 ops each)."""
    dev = torch.device(device)
    if dev.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from kernels.triton.rmsnorm import rmsnorm
        from kernels.triton.rope import apply_rope

        return Elementwise(rmsnorm, apply_rope, ref.silu_mul)
    if dev.type == "cpu" and (dtype or torch.get_default_dtype()) in (torch.float32, torch.bfloat16):
        try:
            from kernels.cpu import ops

            ops.load()
        except Exception as e:  # noqa: BLE001 - any toolchain/loader failure: the reference ops, loudly
            fallbacks.record("elementwise_kernels", f"native cpu norm/rope kernels unavailable "
                                                    f"({str(e).splitlines()[0]}): torch ops")
            return REF_ELEMENTWISE
        return Elementwise(ops.rmsnorm, ops.apply_rope, ops.silu_mul)
    return REF_ELEMENTWISE


def rope_gathered(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [T, H, D] with this step's cos/sin rows [T, 1, D/2] (float32); the same
    arithmetic as kernels.ref.apply_rope (computed in float32, cast back), minus the per-call gather."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    half = cos.shape[-1]
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _cos_sin_rows(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's rows of a rotary table [max_pos, D] as (cos, sin), each [T, 1, D/2]."""
    cs = table[positions].unsqueeze(1)
    half = cs.shape[-1] // 2
    return cs[..., :half], cs[..., half:]


Weight = torch.Tensor | quant.QTensor


@overload
def _frozen(t: torch.Tensor, device: torch.device) -> nn.Parameter: ...
@overload
def _frozen(t: quant.QTensor, device: torch.device) -> quant.QuantWeight: ...
@overload
def _frozen(t: None, device: torch.device) -> None: ...
def _frozen(t: Weight | None, device: torch.device) -> nn.Parameter | quant.QuantWeight | None:
    """A dense weight as a frozen Parameter on `device`; a QTensor packed into the device's kernel layout."""
    if t is None:
        return None
    if isinstance(t, quant.QTensor):
        return quant.to_kernel(t, device)
    return nn.Parameter(t.to(device), requires_grad=False)


def _cat(parts: list[Weight]) -> Weight:
    """Fuse weights along rows (dense tensors or QTensors alike)."""
    if isinstance(parts[0], quant.QTensor):  # parts are alike: cat_rows and torch.cat reject a mix
        return quant.cat_rows(cast("list[quant.QTensor]", parts))
    return torch.cat(cast("list[torch.Tensor]", parts), dim=0).contiguous()


# The linear weights of the model (layers and head), by attribute name: what a runner may repack for its kernels.
LINEAR_WEIGHTS = ("w_qkv", "w_o", "w_gate_up", "w_down", "lm_head")


class LlamaLayer(nn.Module):
    def __init__(self, w: dict[str, Weight], i: int, arch: ModelArch, device: torch.device) -> None:
        super().__init__()
        p = f"model.layers.{i}."
        qkv = [w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        biases = [w.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"] if arch.attention_bias else []
        bias = torch.cat(cast("list[torch.Tensor]", biases)) if biases else None  # biases are never quantized
        d = device
        self.ln_attn = _frozen(w.pop(p + "input_layernorm.weight"), d)  # [H] float32
        self.w_qkv = _frozen(_cat(qkv), d)  # [(Hq + 2 Hkv) * D, H]
        self.b_qkv = _frozen(bias, d)  # [(Hq + 2 Hkv) * D] (Qwen2)
        self.w_o = _frozen(w.pop(p + "self_attn.o_proj.weight"), d)  # [H, Hq * D]
        self.q_norm = _frozen(w.pop(p + "self_attn.q_norm.weight") if arch.qk_norm else None, d)  # [D] (Qwen3)
        self.k_norm = _frozen(w.pop(p + "self_attn.k_norm.weight") if arch.qk_norm else None, d)
        self.ln_post_attn: nn.Parameter | quant.QuantWeight | None = None  # [H] (Gemma: norm of the attention output)
        self.ln_post_mlp: nn.Parameter | quant.QuantWeight | None = None  # [H] (Gemma: norm of the MLP output)
        if arch.post_norms:
            self.ln_post_attn = _frozen(w.pop(p + "post_attention_layernorm.weight"), d)
            self.ln_mlp = _frozen(w.pop(p + "pre_feedforward_layernorm.weight"), d)
            self.ln_post_mlp = _frozen(w.pop(p + "post_feedforward_layernorm.weight"), d)
        else:
            self.ln_mlp = _frozen(w.pop(p + "post_attention_layernorm.weight"), d)  # [H]
        gate_up = _cat([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
        self.w_gate_up = _frozen(gate_up, d)  # [2 I, H]
        self.w_down = _frozen(w.pop(p + "mlp.down_proj.weight"), d)  # [H, I]


class LlamaForCausalLM(nn.Module):
    cos_sin: torch.Tensor  # buffer (register_buffer)
    cos_sin_local: torch.Tensor  # the sliding-window layers' table (the same tensor when they share one)

    def __init__(self, arch: ModelArch, weights: dict[str, Weight], device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> None:
        """weights: {hf_name: tensor | QTensor} (runtime.models.loader); dtype: the activation dtype, which a
        quantized embedding's rows are produced in (default: torch's default dtype). Under tensor parallelism
        (runtime/models/tensor_parallel.py) arch and weights are one rank's shard and `reduce` sums the
        partial outputs of the o and down projections over the ranks."""
        super().__init__()
        self.arch = arch
        self.reduce = reduce
        dev = torch.device(device)
        w = dict(weights)
        embed = w.pop("model.embed_tokens.weight")
        self.embed: quant.QuantEmbedding | nn.Parameter
        if isinstance(embed, quant.QTensor):  # GGUF Q8_0 rows, dequantized on lookup
            self.embed = quant.QuantEmbedding(embed, dtype or torch.get_default_dtype(), dev)
        else:
            self.embed = _frozen(embed, dev)  # [V, H]
        self.norm = _frozen(w.pop("model.norm.weight"), dev)
        head = w.pop("lm_head.weight", None)  # the loader adds one for a tied model whose head is quantized
        self.lm_head: torch.Tensor | quant.QuantWeight
        if head is None:  # tied: the embedding is dense (a quantized one comes with its head)
            assert isinstance(self.embed, torch.Tensor)
            self.lm_head = self.embed
        elif isinstance(head, quant.QTensor):  # kept block scales; bench/results/lm_head.md measures the choice
            self.lm_head = quant.to_kernel(head, dev, exact=True)
            if isinstance(self.lm_head, quant.Q8BlockWeight):  # the q8 GEMV keeps pace with a float32 copy
                self.lm_head.dense_copies = False
        else:
            self.lm_head = _frozen(head, dev)
        self.layers = nn.ModuleList(LlamaLayer(w, i, arch, dev) for i in range(arch.num_layers))
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        cos_sin = ref.rope_cos_sin(arch.head_dim, arch.max_position, arch.rope_theta, arch.rope_scaling, device)
        self.register_buffer("cos_sin", cos_sin, persistent=False)  # [max_pos, D] float32
        local = cos_sin
        if arch.rope_local_theta is not None and arch.sliding_window:
            local = ref.rope_cos_sin(arch.head_dim, arch.max_position, arch.rope_local_theta, None, device)
        self.register_buffer("cos_sin_local", local, persistent=False)
        self.local_layers = tuple(arch.window(i) > 0 for i in range(arch.num_layers))
        self.ew = elementwise_kernels(device, dtype)  # eager row ops; compiled graphs trace REF_ELEMENTWISE
        self.eval()

    def weights_nbytes(self) -> int:
        """Bytes of every weight the forward reads (parameters and quantized buffers; a tied head once)."""
        tables = (self.cos_sin, self.cos_sin_local)
        tensors = {id(t): t for t in [*self.parameters(), *self.buffers()] if all(t is not c for c in tables)}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, attn: BaseAttnBackend) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab] float32. attn.init_forward must have been called for fb."""
        return self.forward_tokens(fb.input_ids, fb.positions, fb.logits_indices, attn.forward)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                       attend: Attend) -> torch.Tensor:
        """input_ids, positions [T] int64; logits_indices [K] int64 -> logits [K, vocab] float32.
        The traceable body: everything but `attend` is plain torch, so torch.compile sees one graph."""
        a = self.arch
        ew = REF_ELEMENTWISE if torch.compiler.is_compiling() else self.ew  # inductor fuses the reference ops
        h = quant.embedding(input_ids, self.embed)  # [T, H]
        if a.embed_scale != 1.0:  # Gemma: the scale rounded to the activation dtype, as the checkpoint trained
            h = h * torch.tensor(a.embed_scale, dtype=torch.float32).to(h.dtype)
        residual: torch.Tensor | None = None
        t = h.shape[0]
        act = ref.gelu_tanh_mul if a.activation == "gelu_tanh" else ew.silu_mul
        if not ew.fused_rope:  # [T, 1, D/2] cos and sin rows, once for all layers (per table)
            rows = {False: _cos_sin_rows(self.cos_sin, positions)}
            if any(self.local_layers):
                rows[True] = _cos_sin_rows(self.cos_sin_local, positions)
        layers: Iterable[LlamaLayer] = self.layers  # type: ignore[assignment]  # nn.ModuleList is not generic
        for i, lw in enumerate(layers):
            local = self.local_layers[i]
            x, residual = ew.rmsnorm(h, lw.ln_attn, a.rms_eps, residual)
            qkv = quant.linear(x, lw.w_qkv, lw.b_qkv)  # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, a.num_heads, a.head_dim)
            k = k.view(t, a.num_kv_heads, a.head_dim)
            v = v.view(t, a.num_kv_heads, a.head_dim)
            if lw.q_norm is not None:
                q = ew.rmsnorm(q, lw.q_norm, a.rms_eps)[0]
                k = ew.rmsnorm(k, lw.k_norm, a.rms_eps)[0]
            if ew.fused_rope:
                q, k = ew.apply_rope(q, k, positions, self.cos_sin_local if local else self.cos_sin)
            else:
                cos, sin = rows[local]
                q, k = rope_gathered(q, cos, sin), rope_gathered(k, cos, sin)
            o = attend(q, k, v, i)  # [T, Hq, D]
            h = quant.linear(o.reshape(t, self.q_size), lw.w_o)
            if self.reduce is not None:
                h = self.reduce(h)  # [T, H]: the sum of every rank's heads
            if lw.ln_post_attn is not None:
                h = ew.rmsnorm(h, lw.ln_post_attn, a.rms_eps)[0]
            x, residual = ew.rmsnorm(h, lw.ln_mlp, a.rms_eps, residual)
            h = quant.linear(act(quant.linear(x, lw.w_gate_up)), lw.w_down)
            if self.reduce is not None:
                h = self.reduce(h)
            if lw.ln_post_mlp is not None:
                h = ew.rmsnorm(h, lw.ln_post_mlp, a.rms_eps)[0]
        assert residual is not None  # set by the first layer
        last = (h + residual)[logits_indices]
        x = ew.rmsnorm(last, self.norm, a.rms_eps)[0]
        logits = quant.linear(x, self.lm_head)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if a.final_logit_softcap:
            logits = torch.tanh(logits / a.final_logit_softcap) * a.final_logit_softcap
        return logits
