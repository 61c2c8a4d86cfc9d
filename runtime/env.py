"""Environment variables: the one module that reads `RADIXGEN_*`.

Everything tunable by users goes through the config dataclasses and CLI flags; these are knobs for operators
and tests that must reach child processes without a flag. Read once per call of `load_env()`, never cached
at import, so tests can set them before launching.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Env:
    detokenizer_max_states: int = 65536
    """RADIXGEN_DETOKENIZER_MAX_STATES: per-rid decode states kept by the detokenizer (LRU beyond)."""
    health_check_timeout: float = 20.0
    """RADIXGEN_HEALTH_CHECK_TIMEOUT: seconds /health_generate waits for its one-token generation."""
    scheduler_factory: str | None = None
    """RADIXGEN_SCHEDULER_FACTORY: "module:function" building the scheduler loop's collaborators instead of
    the real model (plumbing tests use a fake scheduler)."""
    abort_confirm_timeout: float = 30.0
    """RADIXGEN_ABORT_CONFIRM_TIMEOUT: seconds an aborted request's state waits for the scheduler's confirm."""
    parent_poll_interval: float = 0.5
    """RADIXGEN_PARENT_POLL_INTERVAL: how often children check that their parent is still alive."""
    disable_compile: bool = False
    """RADIXGEN_DISABLE_COMPILE: 1 runs the CPU forward eagerly whatever --disable-compile says (tests set it so
    that only the tests marked for it pay for inductor compiles)."""
    cache_dir: str | None = None
    """RADIXGEN_CACHE_DIR: the compiled decode graph cache (default ~/.cache/radixgen/graphs;
    --compile-cache-dir wins)."""


def _get(name: str, cast: Callable[[str], T], default: T) -> T:
    raw = os.environ.get(f"RADIXGEN_{name}")
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"RADIXGEN_{name}={raw!r} is not a valid {cast.__name__}") from None


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def load_env() -> Env:
    d = Env()
    return Env(
        detokenizer_max_states=_get("DETOKENIZER_MAX_STATES", int, d.detokenizer_max_states),
        health_check_timeout=_get("HEALTH_CHECK_TIMEOUT", float, d.health_check_timeout),
        scheduler_factory=_get("SCHEDULER_FACTORY", str, d.scheduler_factory),
        abort_confirm_timeout=_get("ABORT_CONFIRM_TIMEOUT", float, d.abort_confirm_timeout),
        parent_poll_interval=_get("PARENT_POLL_INTERVAL", float, d.parent_poll_interval),
        disable_compile=_get("DISABLE_COMPILE", _flag, d.disable_compile),
        cache_dir=_get("CACHE_DIR", str, d.cache_dir),
    )
