"""`radixgen serve`: start the children, serve HTTP while they load, supervise until exit.

Order (runtime/launch.py `Launch`, the Engine's path too): spawn the scheduler and detokenizer -> bind the
port (uvicorn; /health answers 503 meanwhile) -> load the tokenizer here while the children load -> wait for
both ReadyMsgs -> start the TokenizerManager -> print `radixgen ready on http://HOST:PORT`. Exit paths, each within a few seconds and leaving no child:
SIGTERM/SIGINT (exit 0; running requests drained for --shutdown-timeout seconds, else failed with 503), a
child dying (the reason logged, exit 1), a startup failure (exit 1). The server is a child subreaper and
reaps every descendant before it returns its exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Generator
from typing import Any

import uvicorn

from runtime.config import Config
from runtime.launch import Launch, LaunchError, become_subreaper, reap_children
from runtime.tokenizer.chat_template import check_chat_template, resolve_chat_template
from server.app import create_app
from server.http import ServerState
from server.parsers import detect_tool_parser

logger = logging.getLogger("radixgen")


class _Server(uvicorn.Server):
    """uvicorn without its re-raise of the captured signal: we exit with our own code."""

    def __init__(self, config: uvicorn.Config, on_signal: Any) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(sig: int, frame: Any) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            self._on_signal(sig)

        original = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in original.items():
                signal.signal(s, h)


def _served_name(cfg: Config, model_path: str) -> str:
    if cfg.model.served_model_name:
        return cfg.model.served_model_name
    base = os.path.basename(model_path.rstrip("/"))
    return base[:-5] if base.endswith(".gguf") else base


def _log_parsers(cfg: Config, tokenizer: Any) -> None:
    """Say which reasoning and tool-call parsers serve requests (a tool format chosen from the chat template
    when --tool-call-parser is absent)."""
    srv = cfg.server
    fmt, source = srv.tool_call_parser, "--tool-call-parser"
    if fmt is None:
        try:
            template = resolve_chat_template(srv.chat_template, getattr(tokenizer, "chat_template", None))
        except ValueError:
            template = None
        fmt, source = detect_tool_parser(template), "the chat template"
    logger.info("tool-call parser: %s", f"{fmt} (from {source})" if fmt else
                "none in the chat template: radixgen's generic JSON calls")
    logger.info("reasoning parser: %s", srv.reasoning_parser or "none (--reasoning-parser)")


def run_server(cfg: Config) -> int:
    """Run until a signal or a failure; returns the process exit code."""
    logging.basicConfig(level=cfg.server.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    become_subreaper()
    try:
        check_chat_template(cfg.server.chat_template)
        launch = Launch(cfg)
    except (FileNotFoundError, ValueError) as e:
        logger.error("%s", e)
        return 1
    launch.start()
    try:
        return asyncio.run(_serve(launch))
    finally:
        launch.shutdown()
        reap_children()


async def _serve(launch: Launch) -> int:
    loop = asyncio.get_running_loop()
    cfg = launch.cfg
    model_path = launch.model_path
    state = ServerState(cfg=cfg, model_path=model_path, served_model_name=_served_name(cfg, model_path),
                        config_info=dict(launch.config), health_check_timeout=launch.env.health_check_timeout)
    exit_code = 0

    def fail(reason: str) -> None:
        nonlocal exit_code
        if state.failure or state.shutting_down:
            return
        logger.error("%s; stopping the server", reason)
        exit_code, state.failure = 1, reason
        if state.tm is not None:
            state.tm.fail_all(reason)
        server.should_exit = True
        threading.Thread(target=launch.shutdown, daemon=True).start()

    def on_signal(sig: int) -> None:
        loop.call_soon_threadsafe(begin_shutdown, signal.Signals(sig).name)

    def begin_shutdown(why: str) -> None:
        if state.shutting_down:
            return
        logger.info("%s received: shutting down", why)
        state.shutting_down = True
        drain = cfg.server.shutdown_timeout
        if state.tm is not None:
            if drain > 0:
                loop.call_later(drain, state.tm.fail_all, "the server is shutting down")
            else:
                state.tm.fail_all("the server is shutting down")

    srv = cfg.server
    server = _Server(uvicorn.Config(create_app(state), host=srv.host, port=srv.port, log_level=srv.log_level,
                                    access_log=False, lifespan="off",
                                    # uvicorn annotates an int; its asyncio.timeout takes this float as it is
                                    timeout_graceful_shutdown=max(1.0, srv.shutdown_timeout + 0.5)),  # type: ignore[arg-type]
                     on_signal)
    serving = asyncio.ensure_future(_guard(server.serve()))
    ready_future = _in_thread(loop, launch.wait_ready)
    try:
        ready = await _await_or_exit(ready_future, serving, server)
    except LaunchError as e:
        logger.error("startup failed: %s", e)
        server.should_exit = True
        await serving
        return 1
    except Exception as e:
        logger.error("startup failed: %s: %s", type(e).__name__, e)
        server.should_exit = True
        await serving
        return 1
    if ready is None:  # a signal or a bind failure during startup
        await serving
        return serving.result() or (0 if state.shutting_down else 1)
    tokenizer, model = ready
    state.tm = launch.tokenizer_manager(tokenizer, model, state.metrics)
    _log_parsers(cfg, tokenizer)
    state.ready = True
    gc.collect()
    gc.freeze()  # start-up objects (app, tokenizer) are never scanned again: see runtime/child.py
    launch.watch(lambda reason: loop.call_soon_threadsafe(fail, reason))
    print(f"radixgen ready on http://{srv.host}:{srv.port}", flush=True)
    code = await serving
    await state.tm.close()
    return exit_code or code


async def _guard(coro: Any) -> int:
    """uvicorn's serve(), with a bind failure's SystemExit turned into exit code 1."""
    try:
        await coro
    except SystemExit as e:
        return int(e.code or 1)
    return 0


async def _await_or_exit(fut: Any, serving: asyncio.Future, server: _Server) -> Any:
    """The future's result, or None if the HTTP server stops (signal, bind failure) first."""
    while True:
        done, _ = await asyncio.wait({fut, serving}, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
        if fut in done:
            return fut.result()
        if serving in done or server.should_exit:
            return None


def _in_thread(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> asyncio.Future:
    """Run a blocking call in a daemon thread (so a shutdown never waits for it)."""
    fut = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as e:
            value, ok = e, False
        with contextlib.suppress(RuntimeError):  # the loop may be closed already
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, daemon=True).start()
    return fut


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `radixgen serve` or `python -m server serve`")
