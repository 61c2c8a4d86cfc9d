"""Process-wide knobs of the frontend (SGLang's `global_config` names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    verbosity: int = 0  # >= 2: print each program's final text
    default_backend: Any = None  # set_default_backend()
    enable_precache_with_tracing: bool = True  # run_batch pre-caches the traced constant prefix
    precache_min_chars: int = 64  # ... when it is longer than this
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True


global_config = GlobalConfig()
