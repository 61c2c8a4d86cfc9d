"""Runtime: start a local radixgen server process, wait until it serves, and stop it.

It launches `python -m server --model-path ... --host 127.0.0.1 --port P [flags]` (keyword arguments
become `--dashed-flags`; True -> bare flag, False/None -> omitted), polls `GET /health` until 200 (the
server answers 503 while loading), and exposes `.url` and `.endpoint` (a RuntimeEndpoint). The server
is a separate process: the frontend never imports the server or runtime packages.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from frontend_lang.backend.runtime_endpoint import RuntimeEndpoint


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_flags(kwargs: dict[str, Any]) -> list[str]:
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


class Runtime:
    def __init__(self, model_path: str | None = None, host: str = "127.0.0.1", port: int | None = None,
                 launch_timeout: float = 300.0, log_level: str = "error", api_key: str | None = None,
                 launch_command: list[str] | None = None, cwd: str | None = None, env: dict | None = None,
                 **server_args: Any) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.api_key = api_key
        args = {"model_path": model_path, "host": host, "port": self.port, "log_level": log_level,
                "api_key": api_key, **server_args}
        cmd = (launch_command or [sys.executable, "-m", "server"]) + server_flags(args)
        self.log = tempfile.NamedTemporaryFile(prefix="radixgen-runtime-", suffix=".log", delete=False)  # noqa: SIM115
        self.process: subprocess.Popen | None = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})},
            start_new_session=True)
        atexit.register(self.shutdown)
        try:
            self._wait_ready(launch_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)

    def _wait_ready(self, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"the server exited during launch; log:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready in {timeout:.0f}s; log:\n{self.log_tail()}")

    def generate(self, prompt: str | list[str], sampling_params: dict | None = None, **kwargs: Any) -> Any:
        """A raw native `/generate` call (the response JSON)."""
        return self.endpoint.http.post_json("/generate", {"text": prompt, "sampling_params": sampling_params or {},
                                                          **kwargs})

    def encode(self, prompt: str | list[str]) -> Any:
        """`RuntimeEndpoint.encode` (embedding servers)."""
        return self.endpoint.encode(prompt)

    def score(self, query: str, items: list[str], label_token_ids: list[int], apply_softmax: bool = False) -> Any:
        """`RuntimeEndpoint.score` (generative servers)."""
        return self.endpoint.score(query, items, label_token_ids, apply_softmax)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-n:]

    def shutdown(self) -> None:
        proc, self.process = getattr(self, "process", None), None
        if proc is None:
            return
        if getattr(self, "endpoint", None) is not None:
            self.endpoint.shutdown()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and its children
                proc.wait(timeout=10)
        self.log.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()
