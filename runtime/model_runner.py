"""ModelRunner: owns the model weights, the KV pool, the slot allocator, the request-to-token table and the
attention backend; turns one ForwardBatch into logits.

The scheduler asks for slots from `allocator`, writes them into `req_to_token`, builds a ForwardBatch and
calls `forward(fb)`; the attention backend stores each layer's new K/V into `pool` at `fb.out_cache_loc`.
"""

from __future__ import annotations

import logging

import torch

from kernels import AttnMetadata, create_attn_backend
from runtime.config import Config, resolve
from runtime.forward_batch import ForwardBatch
from runtime.memory import KVPool, ReqToTokenTable, SlotAllocator
from runtime.models.arch import ModelArch
from runtime.models.llama import LlamaForCausalLM
from runtime.models.loader import load_weights, read_eos_ids
from runtime.models.registry import resolve_model_path

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool size on CPU when --max-total-tokens is not given
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, cfg: Config, progress: bool = True) -> None:
        cfg = resolve(cfg)
        self.cfg = cfg
        mc = cfg.model
        self.device = torch.device(mc.device)
        self.dtype = DTYPES[mc.dtype]
        if mc.num_threads and self.device.type == "cpu":
            torch.set_num_threads(mc.num_threads)
        self.model_path = resolve_model_path(mc.model_path)
        arch, weights = load_weights(self.model_path, self.dtype, progress)
        self.arch: ModelArch = arch
        self.model = LlamaForCausalLM(arch, weights, self.device)
        self.vocab_size = arch.vocab_size
        self.eos_token_ids = read_eos_ids(self.model_path)
        self.context_len = min(mc.context_length or arch.max_position, arch.max_position)
        num_slots = self._pool_size(cfg)
        self.pool = KVPool(arch.num_layers, num_slots, arch.num_kv_heads, arch.head_dim, self.dtype, self.device)
        self.allocator = SlotAllocator(num_slots, cfg.cache.page_size, strict=cfg.cache.strict_memory_check)
        self.req_to_token = ReqToTokenTable(cfg.scheduler.max_running_requests, self.context_len, self.device)
        self.attn = create_attn_backend(
            mc.attention_backend, self.pool.k_cache, self.pool.v_cache, arch.head_dim**-0.5
        )
        log.info("model %s: %d layers, KV pool %d slots, backend %s, %s",
                 self.model_path, arch.num_layers, num_slots, mc.attention_backend, mc.dtype)

    def _pool_size(self, cfg: Config) -> int:
        a = self.arch
        per_slot = KVPool.bytes_per_slot(a.num_layers, a.num_kv_heads, a.head_dim, self.dtype)
        if cfg.cache.max_total_tokens:
            n = cfg.cache.max_total_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            n = int(free * cfg.model.mem_fraction_static) // per_slot
        else:
            n = min(CPU_KV_BUDGET_BYTES // per_slot, 16 * self.context_len)
        page = cfg.cache.page_size
        return max(page, n // page * page)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab] float32 for one step."""
        fb = _to_device(fb, self.device)
        meta = AttnMetadata(
            is_decode=fb.is_decode,
            req_to_token=self.req_to_token.table,
            req_pool_indices=fb.req_pool_indices,
            seq_lens=torch.tensor(fb.seq_lens, device=self.device),
            prefix_lens=torch.tensor(fb.prefix_lens, device=self.device),
            extend_lens=torch.tensor(fb.extend_lens, device=self.device),
            out_cache_loc=fb.out_cache_loc,
            seq_lens_cpu=fb.seq_lens,
            prefix_lens_cpu=fb.prefix_lens,
            extend_lens_cpu=fb.extend_lens,
        )
        self.attn.init_forward(meta)
        return self.model.forward(fb, self.attn).cpu()


def _to_device(fb: ForwardBatch, device: torch.device) -> ForwardBatch:
    if device.type == "cpu":
        return fb
    import dataclasses

    return dataclasses.replace(
        fb,
        input_ids=fb.input_ids.to(device, non_blocking=True),
        positions=fb.positions.to(device, non_blocking=True),
        out_cache_loc=fb.out_cache_loc.to(device, non_blocking=True),
        req_pool_indices=fb.req_pool_indices.to(device, non_blocking=True),
        logits_indices=fb.logits_indices.to(device, non_blocking=True),
    )


def create_model_runner(cfg: Config, progress: bool = True) -> ModelRunner:
    return ModelRunner(cfg, progress)
