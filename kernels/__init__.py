"""Kernels behind one narrow seam: a torch reference for every op, Triton/FlashInfer versions loaded lazily.

`import kernels` never imports triton or flashinfer; `create_attn_backend(name, ...)` loads them by name.
The factory lives here, not in kernels/api.py, because the backends import api.py (no import circle).
"""

from __future__ import annotations

import logging

import torch

from kernels.api import AttnMetadata, BaseAttnBackend

__all__ = ["AttnMetadata", "BaseAttnBackend", "create_attn_backend"]
log = logging.getLogger(__name__)


def create_attn_backend(
    name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, windows: tuple[int, ...] = (),
    local_pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> BaseAttnBackend:
    """Factory by name; imports triton / flashinfer only when asked for them.

    windows: per-layer attention windows (0: full attention); with any sliding-window layer the backend is
    wrapped in kernels.sliding_window.SlidingWindowBackend over two instances of the named one.
    local_pool: (k_cache, v_cache, slot_map) of the sliding-window layers' own pool; `k_cache`, `v_cache` then
    hold the full-attention layers only (runtime/executor/swa_memory.py). None: one pool of every layer.

    "cpu" is the native CPU backend (kernels/cpu), compiled on first use: a build failure raises. "auto" on a
    CPU pool picks "cpu" for float32/bfloat16/float16 pools ("torch" for other dtypes) and, when it cannot be
    built or loaded here, falls back to "torch" with one warning.
    """
    if any(windows):
        from kernels.sliding_window import SlidingWindowBackend

        full = create_attn_backend(name, k_cache, v_cache, scale)
        lk, lv, slot_map = local_pool if local_pool is not None else (k_cache, v_cache, None)
        local = type(full)(lk, lv, scale)  # type: ignore[call-arg]  # every backend takes these three
        return SlidingWindowBackend(full, local, lk, lv, scale, windows, slot_map)
    native_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if name == "auto" and k_cache.device.type == "cpu" and k_cache.dtype not in native_dtypes:
        name = "torch"
    if name == "auto" and k_cache.device.type == "cpu":
        try:
            backend = create_attn_backend("cpu", k_cache, v_cache, scale)
            log.info("attention backend auto: native cpu kernels")
            return backend
        except Exception as e:  # noqa: BLE001 - any toolchain/loader failure means: not available here
            from kernels import fallbacks

            fallbacks.record("attention_backend", f"native cpu kernels unavailable ({str(e).splitlines()[0]}): "
                                                  "torch backend")
            return create_attn_backend("torch", k_cache, v_cache, scale)
    if name == "cpu":
        from kernels.cpu.backend import CpuAttnBackend

        return CpuAttnBackend(k_cache, v_cache, scale)
    if name == "torch":
        from kernels.torch_backend import TorchAttnBackend

        return TorchAttnBackend(k_cache, v_cache, scale)
    if name == "triton":
        from kernels.triton.backend import TritonAttnBackend

        return TritonAttnBackend(k_cache, v_cache, scale)
    if name == "flashinfer":
        from kernels.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(k_cache, v_cache, scale)
    raise ValueError(f"unknown attention backend {name!r} (auto, cpu, torch, triton, flashinfer)")
