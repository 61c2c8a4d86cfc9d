"""Fixtures for end-to-end server tests (the process helpers are in tests/server/harness.py).

Modules that need a real server with common flags share one per test session (`default_server`,
`float32_server`): a start loads the model, which costs more than most modules' tests. A module whose tests
change the server's state for good (kill it, fill it) starts its own.
"""

from __future__ import annotations

import pytest

from tests.server.harness import ServerProc


@pytest.fixture
def server_factory():
    """Start servers inside a test; all are stopped at its end."""
    started: list[ServerProc] = []

    def make(*args: str, **kw) -> ServerProc:
        s = ServerProc(*args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def _shared(*args: str):  # noqa: ANN202
    s = ServerProc(*args)
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


@pytest.fixture(scope="session")
def default_server():
    """The default model and flags, a small KV pool, and a generous grammar compile limit (many schemas compile
    at once on a shared CPU; the limit itself is tested with the grammar backend)."""
    yield from _shared("--max-total-tokens", "8192", "--grammar-compile-timeout", "120", "--log-level", "warning")


@pytest.fixture(scope="session")
def float32_server():
    """As `default_server` in float32: tests that compare a cached and an uncached computation exactly (in bf16
    a different matmul shape rounds differently)."""
    yield from _shared("--max-total-tokens", "8192", "--grammar-compile-timeout", "120", "--log-level", "warning",
                       "--dtype", "float32")
