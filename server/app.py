"""The FastAPI application: middleware, error handlers and routers over a `ServerState` (server/http.py).

Routers: `server/native.py` (SGLang's native API), `server/openai/` (the OpenAI-compatible API) and
`server/anthropic/` (Anthropic's Messages API).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from server.anthropic import router as anthropic_router
from server.auth import GuardMiddleware
from server.errors import install_error_handlers
from server.http import JSON, ServerState
from server.metrics import Metrics
from server.mode import ModeMiddleware
from server.native import router as native_router
from server.native_reasoning import router as reasoning_router
from server.openai import router as openai_router

__all__ = ["ServerState", "create_app", "flat_routes"]


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
    app = FastAPI(title="radixgen", default_response_class=JSON, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.radixgen = state
    install_error_handlers(app)
    app.include_router(native_router)
    app.include_router(reasoning_router)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    routes = frozenset(r.path for r in flat_routes(app.routes))
    srv = state.cfg.server
    app.add_middleware(ModeMiddleware, state=state)
    app.add_middleware(_HttpCounter, metrics=state.metrics, routes=routes)
    app.add_middleware(GuardMiddleware, api_key=srv.api_key, max_body_bytes=srv.max_body_bytes)
    return app
