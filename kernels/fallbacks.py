"""Start-up fallbacks of this process: a faster path that could not be used and what runs instead.

Every fallback is `record`ed once: one warning line in the log, and an entry of `recorded()`, which the scheduler
process sends to the server when it is ready (runtime.messages.ModelInfo.fallbacks) and /get_server_info reports
under `fallbacks`. Nothing may fall back silently.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
_recorded: dict[str, str] = {}


def record(part: str, message: str) -> None:
    """`part` (attention_backend, elementwise_kernels, quantization_kernel, ...) runs its fallback: `message` says
    what failed and what runs instead. Logged once per part and process."""
    if part in _recorded:
        return
    _recorded[part] = message
    log.warning("fallback: %s: %s", part, message)


def recorded() -> dict[str, str]:
    return dict(_recorded)
