"""ASGI middleware: the API key check and the request body limit (pure ASGI, so streaming and
disconnect detection pass through untouched)."""

from __future__ import annotations

import hmac
import json
from typing import Any

from server.errors import error_body

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


async def send_error(send: Any, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """401 without `Authorization: Bearer <api_key>` (when a key is set) except on OPEN_PATHS, using a
    constant-time compare; 413 for a Content-Length over `max_body_bytes` (chunked bodies are counted by
    `server.errors.read_json` while reading)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body = app, max_body_bytes
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if (self.key is not None and scope["path"] not in OPEN_PATHS
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.key)):
            return await send_error(send, 401, error_body("invalid or missing API key (Authorization: Bearer)",
                                                               "invalid_request_error", None, "invalid_api_key"))
        too_big = error_body(f"request body larger than {self.max_body} bytes", "invalid_request_error", None,
                             "request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await send_error(send, 413, too_big, [(b"connection", b"close")])
        await self.app(scope, receive, send)
