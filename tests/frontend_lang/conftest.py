from __future__ import annotations

import pytest

import frontend_lang as fl
from tests.frontend_lang.fake_server import FakeServer


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def backend(fake):
    be = fl.RuntimeEndpoint(fake.url)
    yield be
    be.shutdown()
