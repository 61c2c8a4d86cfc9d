"""What every HTTP route module shares: the server state, the JSON response class, SSE framing and the
client-disconnect race. Route modules (server/native.py, server/openai/*) import this, never each other or
server/app.py, so the server package has no import circle.

`ServerState` is filled in by `server/serve.py` as the launch progresses (`tm` and `ready` once the
children reported ready, `failure` if one died). Routes reach it as `request.app.state.radixgen`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.config import Config
from runtime.tokenizer.generate_input import RequestError
from runtime.tokenizer.manager import TokenizerManager
from server.metrics import Metrics
from server.response_store import ResponseStore

T = TypeVar("T")


class JSON(JSONResponse):
    """JSON via msgspec: fast, and non-finite floats (a -inf logprob) become null instead of invalid JSON."""

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ServerState:
    cfg: Config
    metrics: Metrics = field(default_factory=Metrics)
    tm: TokenizerManager | None = None
    ready: bool = False
    shutting_down: bool = False
    failure: str | None = None
    model_path: str = ""
    served_model_name: str = ""
    config_info: dict[str, Any] = field(default_factory=dict)  # the resolved config, flat
    health_check_timeout: float = 20.0
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept for follow-ups

    def require_tm(self) -> TokenizerManager:
        """The TokenizerManager, or a 503 while starting, failing or shutting down."""
        if self.failure:
            raise RequestError(self.failure, None, "server_unavailable", 503, "server_error")
        if self.shutting_down:
            raise RequestError("the server is shutting down", None, "server_unavailable", 503, "server_error")
        if not self.ready or self.tm is None:
            raise RequestError("the server is starting: the model is loading", None, "server_unavailable", 503,
                               "server_error", {"Retry-After": "5"})
        return self.tm


def get_state(request: Request) -> ServerState:
    return request.app.state.radixgen


class ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone
