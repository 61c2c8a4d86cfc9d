"""Launching and supervising the scheduler and detokenizer processes (DESIGN.md section 1).

`ProcessGroup` spawns both children with the multiprocessing 'spawn' context, passing each a plain dict
(flat config, endpoints, parent pid); they load, then report a `ReadyMsg` on the `ready` channel. The parent
waits (`wait_ready`) with a timeout, and `watch` calls back once if a child dies later. `shutdown` stops
them (SIGTERM, then SIGKILL) and removes the socket dir. Children exit by themselves when their parent dies
(PR_SET_PDEATHSIG plus a parent-pid poll) and ignore SIGINT (the parent handles Ctrl-C for the group).

Child loops: the scheduler receives without blocking while it has work (blocking when idle), hands each
message to `Scheduler.handle`, runs `step()`, and pushes `BatchTokenOut` to the detokenizer; control replies
go straight to the TokenizerManager. The detokenizer turns token ids into text deltas.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from runtime.config import Config, make_config
from runtime.ipc import Endpoints, Receiver, Sender, remove_ipc_dir
from runtime.messages import (
    BatchTokenOut,
    InternalStateOut,
    ReadyMsg,
    ReqTokenOut,
    ShutdownReq,
    ToDetokenizer,
    TokenizedGenerateReq,
    ToScheduler,
    ToTokenizer,
)

logger = logging.getLogger(__name__)
CHILDREN = ("scheduler", "detokenizer")
DEFAULT_SCHEDULER_FACTORY = "runtime.launch:create_scheduler"


class LaunchError(RuntimeError):
    """A child failed to start or died; the message says which and why."""


# ---------------------------------------------------------------- child side


def _child_setup(spec: dict, name: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = spec["parent_pid"]
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(15, f"rg-{name}"[:15].encode(), 0, 0, 0)  # PR_SET_NAME: visible in ps/top
            if spec.get("pdeathsig"):
                libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)

    def poll_parent() -> None:
        while True:
            time.sleep(spec.get("parent_poll_interval", 0.5))
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=poll_parent, name="parent-watch", daemon=True).start()
    level = spec["config"].get("log_level", "info").upper()
    logging.basicConfig(level=level, format=f"[%(asctime)s {name}] %(levelname)s %(name)s: %(message)s")


def _start_child(spec: dict, name: str, build: Callable[[Config, zmq.Context], Any]) -> None:
    """Common child body: set up, build (load), report ready or the error, then run the loop."""
    _child_setup(spec, name)
    ctx = zmq.Context()
    ready = Sender(ctx, spec["endpoints"]["ready"], ReadyMsg)
    try:
        loop = build(make_config(**spec["config"]), ctx, spec)
    except BaseException as e:
        logger.error("%s failed to start:\n%s", name, traceback.format_exc())
        ready.send(ReadyMsg(name=name, ok=False, error=f"{type(e).__name__}: {e}"))
        ready.close()
        sys.exit(1)
    ready.send(ReadyMsg(name=name, ok=True, info=loop.info))
    ready.close(linger_ms=-1)  # deliver it whenever the parent listens (the parent watch ends us if it is gone)
    loop.run()
    os._exit(0)


def run_scheduler_process(spec: dict) -> None:
    _start_child(spec, "scheduler", _build_scheduler_loop)


def run_detokenizer_process(spec: dict) -> None:
    _start_child(spec, "detokenizer", _build_detokenizer_loop)


def create_scheduler(cfg: Config) -> tuple[Any, dict[str, Any]]:
    """The real scheduler over the model runner; returns it and what the server needs to know."""
    from runtime.config import resolve
    from runtime.model_runner import create_model_runner
    from runtime.scheduler import Scheduler
    from runtime.tokenizer import load_tokenizer

    cfg = resolve(cfg)
    runner = create_model_runner(cfg, progress=False)
    tok = load_tokenizer(cfg.model.tokenizer_path or cfg.model.model_path)
    sched = Scheduler(runner, runner.allocator, runner.req_to_token, cfg, runner.eos_token_ids,
                      decode_fn=tok.decode, grammar_backend=_grammar_backend(cfg, tok),
                      # Forced grammar text is plain text: control-token spellings stay characters.
                      encode_fn=lambda text: tok.encode(text, add_special_tokens=False, allow_special=False),
                      token_bytes_fn=tok.token_bytes)
    info = {"context_len": runner.context_len, "vocab_size": runner.vocab_size,
            "max_total_num_tokens": runner.pool.num_slots, "config": cfg.to_dict()}
    return sched, info


def _grammar_backend(cfg: Config, tok: Any) -> Any:
    if cfg.grammar.grammar_backend == "none":
        return None
    try:
        mod = importlib.import_module("runtime.constrained")
    except ImportError:
        return None
    create = getattr(mod, "create_grammar_backend", None)
    return create(cfg, tok) if create is not None else None


def _load_factory(path: str) -> Callable[[Config], tuple[Any, dict[str, Any]]]:
    module, _, func = path.partition(":")
    return getattr(importlib.import_module(module), func)


class SchedulerLoop:
    """receive -> handle -> step -> send, forever (until ShutdownReq)."""

    def __init__(self, scheduler: Any, info: dict[str, Any], ctx: zmq.Context, ep: Endpoints) -> None:
        self.scheduler, self.info = scheduler, info
        self._recv = Receiver(ctx, ep.scheduler, ToScheduler)
        self._to_detok = Sender(ctx, ep.detokenizer, ToDetokenizer)
        self._to_tm = Sender(ctx, ep.tokenizer, ToTokenizer)

    def run(self) -> None:
        s = self.scheduler
        idle_wait = True
        while True:
            if s.has_work() and not idle_wait:
                msgs = self._recv.drain()
            else:  # idle: block (1 s slices); busy but nothing came out last step: yield briefly
                first = self._recv.recv(timeout_ms=1000 if not s.has_work() else 1)
                msgs = [] if first is None else [first, *self._recv.drain()]
                if not msgs and not s.has_work():
                    continue
            for msg in msgs:
                if isinstance(msg, ShutdownReq):
                    return
                self._handle(msg)
            outs = s.step()
            if outs:
                self._to_detok.send(BatchTokenOut(outs=outs))
            idle_wait = not outs

    def _handle(self, msg: Any) -> None:
        try:
            reply = self.scheduler.handle(msg)
        except Exception as e:  # a bad request aborts itself only
            if not isinstance(msg, TokenizedGenerateReq):
                raise
            logger.exception("request %s failed", msg.rid)
            fr = {"type": "abort", "message": f"internal error: {type(e).__name__}: {e}"}
            self._to_detok.send(BatchTokenOut(outs=[ReqTokenOut(rid=msg.rid, new_ids=[], finish_reason=fr)]))
            return
        if isinstance(reply, InternalStateOut):
            reply = InternalStateOut(state={**reply.state, **self._grammar_state()})
        if reply is not None:
            self._to_tm.send(reply)

    def _grammar_state(self) -> dict[str, Any]:
        """Grammar compile counters under SGLang's metric names (none without a grammar backend)."""
        stats = getattr(getattr(self.scheduler, "grammar_backend", None), "stats", None)
        if stats is None:
            return {}
        g = stats()
        return {"num_grammar_total": g.get("compile_count", 0) + g.get("cache_hits", 0),
                "num_grammar_cache_hit_total": g.get("cache_hits", 0),
                "num_grammar_timeout_total": g.get("timeouts", 0),
                "grammar_compilation_time_seconds_sum": g.get("compile_time_total", 0.0)}


def _build_scheduler_loop(cfg: Config, ctx: zmq.Context, spec: dict) -> SchedulerLoop:
    factory = _load_factory(spec.get("scheduler_factory") or DEFAULT_SCHEDULER_FACTORY)
    scheduler, info = factory(cfg)
    return SchedulerLoop(scheduler, info, ctx, Endpoints(**spec["endpoints"]))


class DetokenizerLoop:
    def __init__(self, detok: Any, ctx: zmq.Context, ep: Endpoints) -> None:
        self.detok, self.info = detok, {}
        self._recv = Receiver(ctx, ep.detokenizer, ToDetokenizer)
        self._send = Sender(ctx, ep.tokenizer, ToTokenizer)

    def run(self) -> None:
        while True:
            msg = self._recv.recv()
            if isinstance(msg, BatchTokenOut):
                self._send.send(self.detok.process_batch(msg))
            elif isinstance(msg, ShutdownReq):
                return
            else:
                self._send.send(msg)


def _build_detokenizer_loop(cfg: Config, ctx: zmq.Context, spec: dict) -> DetokenizerLoop:
    from runtime.detokenizer import Detokenizer
    from runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.model.tokenizer_path or cfg.model.model_path)
    detok = Detokenizer(tok.decode, spec.get("detokenizer_max_states", 65536))
    return DetokenizerLoop(detok, ctx, Endpoints(**spec["endpoints"]))


# ---------------------------------------------------------------- parent side


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (out of memory, or killed by someone)" if -code == signal.SIGKILL else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {code}" + (" (see its traceback above)" if code else "")


@contextlib.contextmanager
def _main_module_hidden() -> Any:
    """Spawned children re-import the parent's __main__ unless it looks like `python -c`; they only run
    functions of this module, so hide it: an `Engine()` at the top level of a script without an
    `if __name__ == "__main__"` guard then works, and children start faster."""
    main = sys.modules.get("__main__")
    saved = {a: getattr(main, a) for a in ("__file__", "__spec__") if main is not None and hasattr(main, a)}
    try:
        if "__file__" in saved:
            del main.__file__
        if "__spec__" in saved:
            main.__spec__ = None
        yield
    finally:
        for a, v in saved.items():
            setattr(main, a, v)


class ProcessGroup:
    """The scheduler and detokenizer processes of one launch."""

    def __init__(self, cfg: Config, scheduler_factory: str | None = None) -> None:
        from runtime.env import load_env
        from runtime.models.registry import resolve_model_path

        env = load_env()
        flat = cfg.to_dict()
        flat["model_path"] = resolve_model_path(cfg.model.model_path)
        self.config = flat
        self.endpoints, self._ipc_dir = Endpoints.create()
        self._spec = {
            "config": flat, "endpoints": self.endpoints._asdict(), "parent_pid": os.getpid(),
            "pdeathsig": threading.current_thread() is threading.main_thread(),
            "parent_poll_interval": env.parent_poll_interval,
            "scheduler_factory": scheduler_factory or env.scheduler_factory,
            "detokenizer_max_states": env.detokenizer_max_states,
        }
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._ready = Receiver(self._ctx, self.endpoints.ready, ReadyMsg)
        self._ready_closed = False
        self._waiting = False

    def start(self) -> None:
        mp = multiprocessing.get_context("spawn")
        targets = {"scheduler": run_scheduler_process, "detokenizer": run_detokenizer_process}
        with _main_module_hidden():
            for name in CHILDREN:
                p = mp.Process(target=targets[name], args=(self._spec,), name=f"radixgen-{name}")
                p.start()
                self.procs[name] = p
        atexit.register(self.shutdown)

    @property
    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.procs.items()}

    def wait_ready(self, timeout: float) -> dict[str, dict[str, Any]]:
        """Block until every child reports ready; {name: info}. Raises LaunchError naming the failure
        (a child's startup error or exit, the timeout, or `shutdown` being called meanwhile)."""
        deadline = time.monotonic() + timeout
        infos: dict[str, dict[str, Any]] = {}
        with self._lock:
            if self._closing.is_set():
                raise LaunchError("shut down before the children were ready")
            self._waiting = True
        try:
            while len(infos) < len(CHILDREN):
                msg = self._ready.recv(timeout_ms=100)
                if msg is not None:
                    if not msg.ok:
                        raise LaunchError(f"the {msg.name} process failed to start: {msg.error}")
                    infos[msg.name] = msg.info
                    continue
                if self._closing.is_set():
                    raise LaunchError("shut down before the children were ready")
                for name, p in self.procs.items():
                    if name not in infos and not p.is_alive():
                        raise LaunchError(f"the {name} process {describe_exit(p.exitcode)} while starting")
                if time.monotonic() > deadline:
                    missing = [n for n in CHILDREN if n not in infos]
                    raise LaunchError(f"timed out after {timeout:g} s waiting for {', '.join(missing)} to start")
        finally:
            with self._lock:
                self._waiting = False
                self._close_ready()
        return infos

    def _close_ready(self) -> None:
        """Close the ready socket and context (under _lock, never while wait_ready uses them)."""
        if not self._ready_closed:
            self._ready_closed = True
            self._ready.close()
            self._ctx.destroy(linger=0)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` once, from a thread, if a child exits while not shutting down."""
        def run() -> None:
            sentinels = {p.sentinel: name for name, p in self.procs.items()}
            ready = multiprocessing.connection.wait(list(sentinels))
            if self._closing.is_set():
                return
            name = sentinels[ready[0]]
            self.procs[name].join(0.1)
            on_death(f"the {name} process {describe_exit(self.procs[name].exitcode)}")

        threading.Thread(target=run, name="child-watch", daemon=True).start()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL after `timeout`), remove the socket dir. Idempotent."""
        with self._lock:
            self._closing.set()
            alive = [p for p in self.procs.values() if p.pid is not None and p.is_alive()]
            for p in alive:
                with contextlib.suppress(OSError):
                    p.terminate()
            deadline = time.monotonic() + timeout
            for p in alive:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(1.0)
            if not self._waiting:
                self._close_ready()
            remove_ipc_dir(self._ipc_dir)
