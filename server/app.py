"""The FastAPI application: shared server state, middleware, error handlers and routers.

`ServerState` is filled in by `server/serve.py` as the launch progresses (`tm` and `ready` once the
children reported ready, `failure` if one died). Routes reach it as `request.app.state.radixgen`.
Routers: `server/native.py` (SGLang's native API); the OpenAI layer adds its router in `create_app`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from runtime.config import Config
from runtime.tokenizer.generate_input import RequestError
from runtime.tokenizer.manager import TokenizerManager
from server.auth import GuardMiddleware
from server.errors import install_error_handlers
from server.metrics import Metrics


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


class _HttpCounter:
    """Counts responses by route and status for /metrics (route = the matched path template or 'other')."""

    def __init__(self, app: Any, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                self.metrics.on_http(path, msg["status"])
            await send(msg)

        await self.app(scope, receive, counting_send)


def flat_routes(routes: list) -> list:
    """The leaf routes (with `path` and `methods`), looking through included routers (newer FastAPI keeps an
    included router as one wrapper entry in `app.routes`)."""
    out = []
    for r in routes:
        inner = getattr(r, "original_router", None)
        if inner is not None:
            out.extend(flat_routes(inner.routes))
        elif hasattr(r, "path"):
            out.append(r)
    return out


def create_app(state: ServerState) -> FastAPI:
    from server.native import router as native_router

    app = FastAPI(title="radixgen", default_response_class=JSON, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.radixgen = state
    install_error_handlers(app)
    app.include_router(native_router)
    try:  # the OpenAI-compatible layer, when present
        from server.openai import router as openai_router
    except ImportError:
        openai_router = None
    if openai_router is not None:
        app.include_router(openai_router)
    routes = frozenset(r.path for r in flat_routes(app.routes))
    srv = state.cfg.server
    app.add_middleware(_HttpCounter, metrics=state.metrics, routes=routes)
    app.add_middleware(GuardMiddleware, api_key=srv.api_key, max_body_bytes=srv.max_body_bytes)
    return app
