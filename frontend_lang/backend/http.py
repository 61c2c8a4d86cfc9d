"""A small JSON/SSE client over httpx, shared by the backends.

One pooled `httpx.Client` per backend (thread-safe, keep-alive), Bearer auth when an api key is given,
every non-2xx answer turned into `BackendError` with the server's error message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class BackendError(RuntimeError):
    def __init__(self, status: int, message: str, url: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        self.status = status
        self.message = message


class GenerationAborted(BackendError):
    """The server accepted the request but aborted it (finish_reason type "abort")."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(200, message, url)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 verify: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            headers=headers, verify=True if verify is None else verify,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    def _check(self, resp: httpx.Response) -> httpx.Response:
        if resp.status_code >= 300:
            raise BackendError(resp.status_code, _error_message(resp), str(resp.url))
        return resp

    def get_json(self, path: str) -> Any:
        return self._check(self.client.get(self.base_url + path)).json()

    def post_json(self, path: str, body: Any) -> Any:
        return self._check(self.client.post(self.base_url + path, json=body)).json()

    def post_sse(self, path: str, body: Any) -> Iterator[dict]:
        """POST with streaming; yields each `data: {json}` event until `data: [DONE]`."""
        with self.client.stream("POST", self.base_url + path, json=body) as resp:
            if resp.status_code >= 300:
                resp.read()
                self._check(resp)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event and "text" not in event \
                        and "choices" not in event:
                    err = event["error"]
                    raise BackendError(200, str(err.get("message", err) if isinstance(err, dict) else err),
                                       self.base_url + path)
                yield event

    def close(self) -> None:
        self.client.close()
