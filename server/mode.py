"""ASGI middleware: a route of the other serving mode is a 400 that says why (embedding mode serves
/v1/embeddings and /encode; a generative model serves generation and /v1/score), before the body is read.

The mode is the scheduler's (`ModelInfo.is_embedding`, known once the server is ready); until then routes
answer their own 503. Both kinds of route stay refused in depth: the TokenizerManager also refuses a
generation on an encoder and an embedding on a generative model (the Engine's path).
"""

from __future__ import annotations

from typing import Any

from server.auth import send_error
from server.errors import envelope

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/score",
                              "/v1/messages", "/v1/messages/count_tokens"})
EMBEDDING_PATHS = frozenset({"/v1/embeddings", "/encode"})


def mode_error(path: str, is_embedding: bool) -> str | None:
    """Why `path` cannot run in this mode (None: it can)."""
    if is_embedding and path in GENERATION_PATHS:
        return (f"{path} generates text, and this server serves an embedding model (--is-embedding): use "
                "/v1/embeddings or /encode")
    if not is_embedding and path in EMBEDDING_PATHS:
        return (f"{path} needs an embedding model, and this server serves a generative model: start radixgen "
                "with an encoder checkpoint (--is-embedding)")
    return None


class ModeMiddleware:
    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        tm = self.state.tm
        if scope["type"] == "http" and tm is not None and self.state.ready:
            path = scope["path"].rstrip("/") or "/"
            why = mode_error(path, tm.info.is_embedding)
            if why is not None:
                code = "model_not_generative" if tm.info.is_embedding else "model_not_embedding"
                return await send_error(send, 400, envelope(path, 400, why, "invalid_request_error", None, code))
        await self.app(scope, receive, send)
