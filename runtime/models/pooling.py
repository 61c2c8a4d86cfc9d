"""How an encoder's token states become one sentence embedding: the pooling a checkpoint names, read from its
sentence-transformers folder, and the pooling itself over packed sequences.

A sentence-transformers folder lists its modules in `modules.json` (Transformer -> Pooling -> optional
Normalize); the Pooling module's `config.json` names the mode (`pooling_mode_mean_tokens`,
`pooling_mode_cls_token`, `pooling_mode_lasttoken`) and `sentence_bert_config.json` the longest input
(`max_seq_length`). A bare encoder directory (no `modules.json`) pools CLS and normalizes, as SGLang's BERT does.

Packed layout: token states `x` [T, H] hold B sequences back to back, sequence b at rows
[starts[b], starts[b] + lens[b]); pooling returns [B, H] float32.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

POOLING_MODES = ("mean", "cls", "last")
_ST_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "cls"  # one of POOLING_MODES
    normalize: bool = True  # L2-normalize each embedding
    max_seq_length: int | None = None  # longest input the checkpoint was trained for (None: the position table)
    matryoshka_dims: tuple[int, ...] = ()  # dimensions the model was trained to be cut to (empty: only its own)


def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_pooling_config(model_dir: str) -> PoolingConfig:
    """The pooling of a model directory (see the module docstring); a mode radixgen does not implement
    (max, mean of sqrt len, weighted mean) raises ValueError naming it."""
    modules_file = os.path.join(model_dir, "modules.json")
    hf = _read(os.path.join(model_dir, "config.json")) if os.path.isfile(os.path.join(model_dir, "config.json")) else {}
    dims = tuple(int(d) for d in hf.get("matryoshka_dimensions") or ())
    if not os.path.isfile(modules_file):
        return PoolingConfig(matryoshka_dims=dims)
    modules = _read(modules_file)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    mode, normalize = "cls", "Normalize" in kinds
    if "Pooling" in kinds:
        pcfg = _read(os.path.join(model_dir, kinds["Pooling"].get("path", ""), "config.json"))
        on = [k for k, v in pcfg.items() if k.startswith("pooling_mode_") and v is True]
        unknown = [k for k in on if k not in _ST_KEYS]
        if unknown or len(on) != 1:
            raise ValueError(f"{model_dir}: pooling {on} is not supported (exactly one of mean, cls, last)")
        mode = _ST_KEYS[on[0]]
    other = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if other:
        raise ValueError(f"{model_dir}: sentence-transformers modules {sorted(other)} are not supported")
    st_file = os.path.join(model_dir, "sentence_bert_config.json")
    max_len = _read(st_file).get("max_seq_length") if os.path.isfile(st_file) else None
    return PoolingConfig(mode=mode, normalize=normalize, max_seq_length=max_len, matryoshka_dims=dims)


def pool(x: torch.Tensor, lens: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """[T, H] packed token states of sequences with `lens` [B] int64 (on x's device) -> [B, H] float32."""
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    if mode == "cls":
        out = x[starts]
    elif mode == "last":
        out = x[ends - 1]
    elif mode == "mean":
        seg = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
        out = torch.zeros(len(lens), x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, seg, x.float())
        out /= lens[:, None].to(torch.float32)
    else:
        raise ValueError(f"unknown pooling mode {mode!r} ({', '.join(POOLING_MODES)})")
    out = out.float()
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out
