"""Fixtures for end-to-end server tests (the process helpers are in tests/server/harness.py; the session-wide
real servers `default_server` and `float32_server` are in tests/conftest.py)."""

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
