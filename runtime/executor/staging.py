"""Host-to-device upload of one step's small metadata without synchronous (pageable) copies.

Every step the model runner and the sampler send a few small vectors to the GPU (token ids, positions,
slots, table rows, lengths, sampling parameters). Copied from pageable memory, each is a synchronous transfer
that waits for the GPU to drain. Here they are packed into one tensor in pinned memory and sent with a
single non_blocking copy, then sliced on the device.

Pinned blocks come from torch's caching host allocator, which records the copy on the stream and does not
hand the block out again before that copy has finished, so dropping the host tensor right away is safe.
On CPU both functions return their inputs as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-D host tensors of one dtype -> the same values on `device`, as views into one buffer."""
    if device.type != "cuda":
        return list(parts)
    flat = torch.cat([p.reshape(-1) for p in parts]).pin_memory().to(device, non_blocking=True)
    return list(flat.split([p.numel() for p in parts]))


def to_device(values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small host list or tensor on `device` (through pinned memory on CUDA)."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
