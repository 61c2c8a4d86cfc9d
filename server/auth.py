"""ASGI middleware: the API key check and the request body limit (pure ASGI, so streaming and
disconnect detection pass through untouched)."""

from __future__ import annotations

import hmac
import json
from typing import Any

from server.errors import envelope

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


async def send_error(send: Any, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """401 without the API key (when one is set) except on OPEN_PATHS: `Authorization: Bearer <api_key>` (OpenAI
    clients) or `x-api-key: <api_key>` (Anthropic clients), each compared in constant time; 413 for a
    Content-Length over `max_body_bytes` (chunked bodies are counted by `server.errors.read_json` while
    reading). Errors come in the envelope of the route asked for (server/errors.py `envelope`)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body = app, max_body_bytes
        self.bearer = f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self.bearer is not None and self.key is not None
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
        return bearer_ok or key_ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        if self.key is not None and path not in OPEN_PATHS and not self._authorized(headers):
            body = envelope(path, 401, "invalid or missing API key (Authorization: Bearer, or x-api-key)",
                            "invalid_request_error", None, "invalid_api_key")
            return await send_error(send, 401, body)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            too_big = envelope(path, 413, f"request body larger than {self.max_body} bytes",
                               "invalid_request_error", None, "request_too_large")
            return await send_error(send, 413, too_big, [(b"connection", b"close")])
        await self.app(scope, receive, send)
