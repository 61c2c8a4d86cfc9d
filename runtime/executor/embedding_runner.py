"""EmbeddingRunner: the encoder's weights and pooling; turns one step's inputs into embeddings.

The embedding scheduler (runtime/scheduler/embedding.py) hands `embed` the token ids of the inputs it batched
for a step; they are packed into one [T] row of tokens, run through the encoder (runtime/models/bert.py),
pooled per input (runtime/models/pooling.py) and returned as float32 [B, dim] on the host. There is no KV pool:
nothing outlives the step.
"""

from __future__ import annotations

import logging

import torch

from runtime.config import Config, resolve
from runtime.models.bert import BertEncoder, load_bert_weights
from runtime.models.pooling import pool, read_pooling_config
from runtime.models.registry import resolve_model_path

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmbeddingRunner:
    def __init__(self, cfg: Config) -> None:
        cfg = resolve(cfg)
        mc = cfg.model
        self.device = torch.device(mc.device)
        if mc.dtype not in DTYPES:
            raise ValueError(f"--dtype {mc.dtype} is not supported for an encoder ({', '.join(DTYPES)})")
        if mc.num_threads and self.device.type == "cpu":
            torch.set_num_threads(mc.num_threads)
        self.model_path = resolve_model_path(mc.model_path)
        arch, weights = load_bert_weights(self.model_path, DTYPES[mc.dtype])
        self.arch = arch
        self.pooling = read_pooling_config(self.model_path)
        self.model = BertEncoder(arch, weights, self.device)
        self.vocab_size = arch.vocab_size
        self.dim = arch.hidden_size
        limit = min(self.pooling.max_seq_length or arch.max_position, arch.max_position)
        self.context_len = min(mc.context_length or limit, limit)
        log.info("encoder %s: %d layers, hidden %d, %s pooling%s, max %d tokens per input, %s on %s, %.1f MB",
                 self.model_path, arch.num_layers, arch.hidden_size, self.pooling.mode,
                 " + normalize" if self.pooling.normalize else "", self.context_len, mc.dtype, self.device,
                 self.model.weights_nbytes() / 2**20)

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """float32 [len(inputs), dim] on the host for non-empty id lists of at most context_len tokens. Inputs
        are packed longest first (the encoder pads attention per group of similar lengths) and the rows put
        back in the callers' order."""
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        inputs = [inputs[i] for i in order]
        lens = [len(ids) for ids in inputs]
        ids = torch.tensor([t for x in inputs for t in x], dtype=torch.int64)
        pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
        ids, pos = ids.to(self.device), pos.to(self.device)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            x = self.model.forward(ids, pos, lens)
            out = pool(x, lens_t, self.pooling.mode, self.pooling.normalize)
        back = torch.empty(len(order), dtype=torch.int64)
        back[torch.tensor(order)] = torch.arange(len(order))
        return out.cpu()[back]
