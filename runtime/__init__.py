"""radixgen's engine: config, messages, request state, memory, scheduler, models, Engine."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    """`runtime.Engine` without importing the process machinery on `import runtime`."""
    if name == "Engine":
        from runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
