"""A BERT-family encoder (BertModel: bidirectional attention, absolute learned positions, token types,
post-layernorm blocks, exact-erf GELU) for embedding models such as all-MiniLM-L6-v2.

Data flow of one step (runtime/executor/embedding_runner.py): B sequences packed into T tokens ->
embeddings (word + position + token type, LayerNorm) -> L blocks -> token states [T, H]. Every matmul runs on
the packed [T, *] rows (no padding compute); only attention is padded, per group of sequences of similar
length: each layer scatters a group's q/k/v into [n, heads, Lmax, head_dim], masks the padded keys and gathers
the real rows back (a lone sequence runs unpadded). Nothing is cached
between steps: an encoder computes every token of every input once.

Weights: Hugging Face names (`embeddings.word_embeddings.weight`, `encoder.layer.{i}.attention.self.query.weight`,
...), with or without a `bert.` prefix; q/k/v are fused into one [3H, H] matrix at load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open

ENCODER_MODEL_TYPES = ("bert",)


@dataclass(frozen=True)
class BertArch:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def from_hf_config(cfg: dict) -> BertArch:
        if cfg.get("model_type") not in ENCODER_MODEL_TYPES:
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not an encoder radixgen serves "
                             f"({', '.join(ENCODER_MODEL_TYPES)})")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r}: only absolute is supported")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r}: only gelu is supported")
        return BertArch(hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
                        num_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
                        vocab_size=cfg["vocab_size"], max_position=cfg.get("max_position_embeddings", 512),
                        type_vocab_size=cfg.get("type_vocab_size", 2), layer_norm_eps=cfg.get("layer_norm_eps", 1e-12))


def read_encoder_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_encoder_checkpoint(model_path: str | None) -> bool:
    """A model directory whose config.json names an encoder model_type (the --is-embedding auto-detection)."""
    if model_path is None or not os.path.isfile(os.path.join(model_path, "config.json")):
        return False
    try:
        return read_encoder_config(model_path).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError):
        return False


def load_bert_weights(model_dir: str, dtype: torch.dtype) -> tuple[BertArch, dict[str, torch.Tensor]]:
    """(arch, {name without `bert.` prefix: tensor in `dtype`}) from the directory's *.safetensors."""
    arch = BertArch.from_hf_config(read_encoder_config(model_dir))
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no .safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(model_dir, name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                weights[key.removeprefix("bert.")] = f.get_tensor(key).to(dtype)
    return arch, weights


class _Layer:
    """One post-LN block's weights: fused qkv [3H, H], output [H, H], FFN up [I, H] and down [H, I]."""

    def __init__(self, w: dict[str, torch.Tensor], i: int) -> None:
        p = f"encoder.layer.{i}."
        s = p + "attention.self."
        self.qkv_w = torch.cat([w[s + n + ".weight"] for n in ("query", "key", "value")]).contiguous()
        self.qkv_b = torch.cat([w[s + n + ".bias"] for n in ("query", "key", "value")]).contiguous()
        self.o_w, self.o_b = w[p + "attention.output.dense.weight"], w[p + "attention.output.dense.bias"]
        self.ln1 = (w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
        self.up_w, self.up_b = w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"]
        self.down_w, self.down_b = w[p + "output.dense.weight"], w[p + "output.dense.bias"]
        self.ln2 = (w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])


class BertEncoder:
    """Token states of packed sequences. `forward(ids [T], positions [T], lens [B] host list)` -> [T, H]."""

    def __init__(self, arch: BertArch, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        self.arch = arch
        w = {k: v.to(device) for k, v in weights.items()}
        self.word = w["embeddings.word_embeddings.weight"]
        self.pos = w["embeddings.position_embeddings.weight"]
        self.type0 = w["embeddings.token_type_embeddings.weight"][0]  # single-segment inputs: token type 0
        self.emb_ln = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.layers = [_Layer(w, i) for i in range(arch.num_layers)]
        self.device = device

    def weights_nbytes(self) -> int:
        ts = [self.word, self.pos, self.type0, *self.emb_ln]
        for lyr in self.layers:
            ts += [lyr.qkv_w, lyr.qkv_b, lyr.o_w, lyr.o_b, *lyr.ln1, lyr.up_w, lyr.up_b, lyr.down_w, lyr.down_b, *lyr.ln2]
        return sum(t.numel() * t.element_size() for t in ts)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, lens: list[int]) -> torch.Tensor:
        a = self.arch
        H, eps = a.hidden_size, a.layer_norm_eps
        x = self.word[ids] + self.pos[positions] + self.type0
        x = F.layer_norm(x, (H,), *self.emb_ln, eps)
        pad = _Padding(lens, positions, self.device)
        for lyr in self.layers:
            attn = pad.attention(F.linear(x, lyr.qkv_w, lyr.qkv_b), a.num_heads, a.head_dim)
            x = F.layer_norm(x + F.linear(attn, lyr.o_w, lyr.o_b), (H,), *lyr.ln1, eps)
            h = F.gelu(F.linear(x, lyr.up_w, lyr.up_b))
            x = F.layer_norm(x + F.linear(h, lyr.down_w, lyr.down_b), (H,), *lyr.ln2, eps)
        return x


GROUP_RATIO = 0.5  # a sequence joins a length group while at least this fraction of its first (longest)


class _Group:
    """Consecutive sequences of similar length padded together: packed rows [a, b) go to padded rows `dst`
    (local sequence * Lmax + position) of an [n, Lmax] block; `mask` [n, 1, 1, Lmax] hides the padded keys."""

    def __init__(self, a: int, lens: list[int], device: torch.device) -> None:
        self.n, self.L = len(lens), max(lens)
        self.a, self.b = a, a + sum(lens)
        if self.n == 1:  # one sequence: no padding
            return
        dst = [i * self.L + p for i, n in enumerate(lens) for p in range(n)]
        self.dst = torch.tensor(dst, dtype=torch.int64, device=device)
        lens_t = torch.tensor(lens, device=device)
        self.mask = (torch.arange(self.L, device=device)[None, :] < lens_t[:, None])[:, None, None, :]


class _Padding:
    """Attention over packed rows: consecutive sequences of similar length form a group (a sequence joins while
    it is no longer than the group's first and at least GROUP_RATIO of it; the runner packs inputs longest first,
    so a short one is not padded to the batch's longest), each group padded to its own longest and masked; built
    once a step, used by every layer."""

    def __init__(self, lens: list[int], positions: torch.Tensor, device: torch.device) -> None:
        runs: list[tuple[int, list[int]]] = []
        a = 0
        for n in lens:
            if runs and GROUP_RATIO * runs[-1][1][0] <= n <= runs[-1][1][0]:
                runs[-1][1].append(n)
            else:
                runs.append((a, [n]))
            a += n
        self.groups = [_Group(start, ls, device) for start, ls in runs]

    def attention(self, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """qkv [T, 3H] -> attention output [T, H]."""
        T, H = qkv.shape[0], heads * head_dim
        out = qkv.new_empty(T, H)
        for g in self.groups:
            a, b = g.a, g.b
            if g.n == 1:
                q, k, v = qkv[a:b].view(1, b - a, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
                out[a:b] = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b - a, H)
                continue
            padded = qkv.new_zeros(g.n * g.L, 3 * H)  # zeros: masked keys must hold finite values
            padded[g.dst] = qkv[a:b]
            q, k, v = padded.view(g.n, g.L, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            res = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask)
            out[a:b] = res.transpose(1, 2).reshape(g.n * g.L, H)[g.dst]
        return out
