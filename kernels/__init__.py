"""Kernels behind one narrow seam: a torch reference for every op, Triton/FlashInfer versions loaded lazily.

`import kernels` never imports triton or flashinfer; `create_attn_backend(name, ...)` loads them by name.
"""

from kernels.api import AttnMetadata, BaseAttnBackend, create_attn_backend

__all__ = ["AttnMetadata", "BaseAttnBackend", "create_attn_backend"]
