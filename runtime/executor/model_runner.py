"""ModelRunner: owns the model weights, the KV pool, the slot allocator, the request-to-token table and the
attention backend; turns one ForwardBatch into logits.

The scheduler asks for slots from `allocator`, writes them into `req_to_token`, builds a ForwardBatch and
calls `forward(fb)`; the attention backend stores each layer's new K/V into `pool` at `fb.out_cache_loc`.

On CUDA: weights and pool live on the GPU (bf16 by default), the pool is sized from --mem-fraction-static
(runtime.executor.memory.gpu_kv_slots), the step's metadata goes up in one pinned copy (runtime.executor.staging), decode
batches up to the largest bucket replay captured CUDA graphs (runtime.executor.cuda_graph) unless
--disable-cuda-graph, and the logits stay on the device: the only host sync of a decode step is the
scheduler reading the sampled ids.

On CPU: bf16 by default where the CPU has native bf16 (runtime.config.resolve), and decode batches up to
--compile-max-bs run through torch.compile'd graphs per bucket (runtime.executor.compiled) unless
--disable-compile or RADIXGEN_DISABLE_COMPILE=1 (larger decode batches in max-bucket chunks); extend and
mixed steps run eagerly.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch

from kernels import create_attn_backend, quant
from kernels.cpu import ops as cpu_ops
from kernels.quant.w8a8 import describe_plan as describe_int8_plan
from runtime.config import Config, resolve
from runtime.env import load_env
from runtime.executor import tp
from runtime.executor.calibration_cache import calibration_store
from runtime.executor.compile_manager import CompileManager
from runtime.executor.compiled import build_compiled_decode, start_packaged_decode
from runtime.executor.cuda_graph import CudaGraphRunner, DecodeGraphRunner
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.memory import KVPool, ReqToTokenTable, SlotAllocator, gpu_kv_slots
from runtime.executor.staging import upload
from runtime.executor.swa_memory import SWASlotAllocator, check_hybrid_swa
from runtime.models import tensor_parallel
from runtime.models.arch import ModelArch
from runtime.models.int8_calibration import DENSE_CLASSES as INT8_DENSE_CLASSES
from runtime.models.int8_calibration import setup_int8
from runtime.models.llama import LINEAR_WEIGHTS, LlamaForCausalLM
from runtime.models.loader import load_weights, read_eos_ids
from runtime.models.quant_policy import W8A8
from runtime.models.quant_policy import describe as describe_quantized
from runtime.models.registry import resolve_model_path

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool size on CPU when --max-total-tokens is not given
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, cfg: Config, progress: bool = True, tp_rank: int = 0) -> None:
        """tp_rank: this process's tensor-parallel rank (0: the scheduler's; see runtime/executor/tp.py)."""
        cfg = resolve(cfg)
        self.cfg = cfg
        mc = cfg.model
        self.device = torch.device(mc.device)
        self.dtype = DTYPES[mc.dtype]
        self.kv_dtype = DTYPES[mc.kv_cache_dtype]  # the KV pool's elements (float16 under a float32 model: see config)
        self.tp_size, self.tp_rank = cfg.parallel.tp_size, tp_rank
        threads = mc.num_threads if self.tp_size == 1 else tp.threads_per_rank(cfg)
        if threads and self.device.type == "cpu":
            torch.set_num_threads(threads)
        self.model_path = resolve_model_path(mc.model_path)
        if self.device.type == "cpu":
            quant.set_cpu_kernel(mc.quantization_kernel)  # the layout CPU quantized weights are packed in
        arch, weights = load_weights(self.model_path, self.dtype, progress, mc.quantization,
                                     mc.quantization_group_size)
        quantized = describe_quantized(weights)
        reduce = None
        if self.tp_size > 1:  # this rank's heads and MLP columns (the whole model's shape checked first)
            weights = dict(tensor_parallel.shard_weights(weights, arch, tp_rank, self.tp_size))
            arch = tensor_parallel.local_arch(arch, self.tp_size)
            tp.init_group(cfg, tp_rank)
            reduce = tensor_parallel.all_reduce_sum()
        self.arch: ModelArch = arch
        self.model = LlamaForCausalLM(arch, weights, self.device, self.dtype, reduce=reduce)
        self.dense_copy_bytes = 0  # copies of quantized weights for batched calls (--quantization-dense-rows)
        self.int8_linears = 0  # W8A8 linears (--quantization w8a8_int8): int8 arithmetic for calls of many rows
        self.int8_calibration = ""  # where their calibration record came from: "cache" or "computed" (+ why unsaved)
        if mc.quantization == W8A8:  # int8 classes calibrated; the rest keep dense copies below (int8_calibration)
            store = calibration_store(self.model_path, mc.quantization_group_size,
                                      mc.compile_cache_dir or load_env().cache_dir, mc.compile_cache_max_mb << 20)
            self.int8_linears = len(setup_int8(self.model, mc.quantization_int8_rows, store))
            self.int8_calibration = store.source
            log.info("int8 calibration record: %s", store.source)
            dense = (f"; {'/'.join(INT8_DENSE_CLASSES)} rows >= {mc.quantization_int8_rows}: dense {mc.dtype} copy"
                     if INT8_DENSE_CLASSES else "")
            log.info("%s%s", describe_int8_plan(self.model, LINEAR_WEIGHTS), dense)
            for m in self.model.modules():
                for name in INT8_DENSE_CLASSES:
                    w = m._modules.get(name)
                    if isinstance(w, quant.QuantWeight):
                        self.dense_copy_bytes += quant.keep_dense_copies(w, mc.quantization_int8_rows, self.dtype)
        elif self.device.type == "cpu" and mc.quantization_dense_rows > 0:
            self.dense_copy_bytes = quant.keep_dense_copies(self.model, mc.quantization_dense_rows, self.dtype)
        self.panel_weights = 0  # dense float32 linears held as column panels (kernels/cpu/linear.cpp)
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_ops.panels_preferred():
            self.panel_weights = quant.pack_dense_panels(self.model, LINEAR_WEIGHTS)
        self.weights_bytes = self.model.weights_nbytes()  # everything the weights hold, copies included
        log.info("weights: %.1f MB on %s (quantization %s: %s)%s%s", self.weights_bytes / 2**20, self.device,
                 mc.quantization, quantized,
                 f", of which {self.dense_copy_bytes / 2**20:.1f} MB {str(self.dtype).removeprefix('torch.')} "
                 f"copies for calls of >= "
                 f"{mc.quantization_dense_rows} rows" if self.dense_copy_bytes else "",
                 f", {self.panel_weights} dense float32 linears in column panels" if self.panel_weights else "")
        self.vocab_size = arch.vocab_size
        self.eos_token_ids = read_eos_ids(self.model_path)
        self.context_len = min(mc.context_length or arch.max_position, arch.max_position)
        # sliding-window layers in their own pool (runtime/executor/swa_memory.py) unless turned off
        self.hybrid_swa = any(arch.layer_windows) and not cfg.cache.disable_hybrid_swa_memory
        if self.hybrid_swa:
            check_hybrid_swa(cfg)
        self._init_pool(self._pool_size(cfg), progress)

    def _init_pool(self, num_slots: int, progress: bool) -> None:
        """The KV pool, its allocator, the request-to-token table, the attention backend over the pool and the
        decode graphs (which capture all of these)."""
        cfg, mc, arch = self.cfg, self.cfg.model, self.arch
        windows = tuple(arch.window(i) for i in range(arch.num_layers))
        self.swa_pool: KVPool | None = None
        self.allocator: SlotAllocator
        local = None
        if self.hybrid_swa:  # full layers in `pool`, sliding layers in `swa_pool`, full slot -> SWA slot map
            swa_slots = max(1, int(num_slots * cfg.cache.swa_full_tokens_ratio))
            n_swa = sum(1 for w in windows if w)
            self.pool = KVPool(arch.num_layers - n_swa, num_slots, arch.num_kv_heads, arch.head_dim, self.kv_dtype,
                               self.device)
            self.swa_pool = KVPool(n_swa, swa_slots, arch.num_kv_heads, arch.head_dim, self.kv_dtype, self.device)
            self.allocator = SWASlotAllocator(num_slots, swa_slots, arch.sliding_window, self.device,
                                              cfg.cache.strict_memory_check)
            local = (self.swa_pool.k_cache, self.swa_pool.v_cache, self.allocator.full_to_swa)
            log.info("sliding-window KV pool: %d slots for %d sliding layers (window %d), full pool %d slots for "
                     "%d layers", swa_slots, n_swa, arch.sliding_window, num_slots, arch.num_layers - n_swa)
        else:
            self.pool = KVPool(arch.num_layers, num_slots, arch.num_kv_heads, arch.head_dim, self.kv_dtype,
                               self.device)
            self.allocator = SlotAllocator(num_slots, cfg.cache.page_size, strict=cfg.cache.strict_memory_check)
        self.req_to_token = ReqToTokenTable(cfg.scheduler.max_running_requests, self.context_len, self.device)
        self.attn = create_attn_backend(mc.attention_backend, self.pool.k_cache, self.pool.v_cache, arch.attn_scale,
                                        windows, local)
        log.info("model %s: %d layers, KV pool %d slots (%s), backend %s, %s",
                 self.model_path, arch.num_layers, num_slots, mc.kv_cache_dtype, mc.attention_backend, mc.dtype)
        self.graph_runner: DecodeGraphRunner | None = None
        self.compile: CompileManager | None = None  # --compile-mode background/sync: buckets and their source
        if self.tp_size > 1:
            log.info("tensor parallel rank %d/%d: eager forward (no compiled or captured graphs)", self.tp_rank,
                     self.tp_size)
        elif self.device.type == "cpu" and mc.compile_mode != "off" and not load_env().disable_compile:
            max_bs = min(mc.compile_max_bs, cfg.scheduler.max_running_requests)
            if mc.compile_mode == "jit":
                self.graph_runner = build_compiled_decode(
                    self.model, self.attn, self.req_to_token.table, self.pool.pad_slot, max_bs, progress
                )
            else:
                self.compile = start_packaged_decode(mc, self.model_path, self.model, self.attn,
                                                     self.req_to_token.table, self.pool.pad_slot, max_bs)
                self.graph_runner = self.compile.graphs
        if self.device.type == "cuda" and not mc.disable_cuda_graph and self.tp_size == 1:
            if self.attn.supports_cuda_graph:
                max_bs = min(mc.cuda_graph_max_bs, cfg.scheduler.max_running_requests)
                self.graph_runner = CudaGraphRunner(
                    self.model, self.attn, self.req_to_token.table, self.pool.pad_slot, max_bs
                )
                self.graph_runner.capture()
            else:
                log.warning("attention backend %s cannot run under CUDA graphs: decoding eagerly",
                            mc.attention_backend)

    def compile_state(self) -> dict[str, object]:
        """Which decode buckets run compiled and where they came from (empty unless background/sync)."""
        if self.compile is None:
            return {}
        return self.compile.state()

    def sibling(self, num_slots: int | None = None) -> ModelRunner:
        """A runner over the same weights with its own KV pool (`num_slots`, default as many as this one's),
        allocator, table and decode graphs: the model as its own speculative draft without a second copy of
        its weights."""
        if self.tp_size > 1:
            raise ValueError("a tensor-parallel runner has no sibling (its weights are sharded over ranks)")
        twin = copy.copy(self)
        twin._init_pool(num_slots or self.pool.num_slots, progress=False)
        return twin

    def _pool_size(self, cfg: Config) -> int:
        a = self.arch
        per_slot = KVPool.bytes_per_slot(a.num_layers, a.num_kv_heads, a.head_dim, self.kv_dtype)
        if self.hybrid_swa:  # each full slot brings swa_full_tokens_ratio sliding-layer slots
            n_swa = sum(1 for w in a.layer_windows if w)
            per_layer = KVPool.bytes_per_slot(1, a.num_kv_heads, a.head_dim, self.kv_dtype)
            per_slot = int(per_layer * (a.num_layers - n_swa + cfg.cache.swa_full_tokens_ratio * n_swa)) or 1
        if cfg.cache.max_total_tokens:
            n = cfg.cache.max_total_tokens
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            n = gpu_kv_slots(total, free, cfg.model.mem_fraction_static, per_slot, cfg.cache.page_size)
        else:
            n = min(CPU_KV_BUDGET_BYTES // per_slot, 16 * self.context_len)
        page = cfg.cache.page_size
        n = max(page, n // page * page)
        if self.tp_size > 1:  # every rank's pool has the same slots (rank 0's allocator hands them out)
            import torch.distributed as dist

            t = torch.tensor([n], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            n = int(t.item())
        return n

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab] float32 on the model's device for one step (on CUDA a
        graph replay's logits are a view valid until the next forward). Under tensor parallelism rank 0 first
        sends the step to the other ranks, which run it too (`forward_local`)."""
        self.req_to_token.flush()
        if isinstance(self.allocator, SWASlotAllocator):
            self.allocator.flush()
        if self.tp_size > 1:
            tp.broadcast_step(tp.step_payload(fb, self.req_to_token.table))
        return self.forward_local(fb)

    def forward_local(self, fb: ForwardBatch) -> torch.Tensor:
        """This rank's forward of `fb` (its req_to_token rows already in the table)."""
        if self.compile is not None:
            self.compile.poll()  # a step boundary: swap in buckets compiled since the last step
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        lens = [torch.tensor(x, dtype=torch.int64) for x in (fb.seq_lens, fb.prefix_lens, fb.extend_lens)]
        ids, pos, loc, rows, logit_idx, seq, pre, ext = upload(
            [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.logits_indices, *lens],
            self.device,
        )
        fb = dataclasses.replace(fb, input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=rows,
                                 logits_indices=logit_idx)
        meta = fb.attn_metadata(self.req_to_token.table, seq, pre, ext)
        self.attn.init_forward(meta)
        return self.model.forward(fb, self.attn)


def create_model_runner(cfg: Config, progress: bool = True) -> ModelRunner:
    return ModelRunner(cfg, progress)
