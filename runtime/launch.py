"""Launching and supervising the child processes (the parent side): the one launch path of `runtime.Engine`
and `radixgen serve`.

`Launch` resolves the config once (the children get the resolved flat config), starts the `ProcessGroup`,
loads the tokenizer here while the children load (`wait_ready` -> tokenizer and the scheduler's `ModelInfo`)
and builds the TokenizerManager on the caller's event loop. `ProcessGroup` spawns the scheduler (runtime/scheduler/process.py) and the detokenizer
(runtime/detokenizer/process.py) with the multiprocessing 'spawn' context, passing each a plain dict (flat
config, endpoints, parent pid); they load, then report a `ReadyMsg` on the `ready` channel
(runtime/child.py). The parent waits (`wait_ready`) with a timeout, and `watch` calls back once if a child
dies later. `shutdown` stops them (SIGTERM, then SIGKILL), reaps them and removes the socket dir.
A dedicated supervisor (the HTTP server) also calls `become_subreaper()` first and `reap_children()` last, so
orphaned grandchildren (the grammar compile worker of a killed scheduler) are reaped too and no process of
the tree outlives the moment its exit status is observable.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from runtime.config import Config, resolve
from runtime.env import load_env
from runtime.ipc import Endpoints, Receiver, remove_ipc_dir
from runtime.messages import ModelInfo, ReadyMsg
from runtime.models.registry import resolve_model_path
from runtime.tokenizer.manager import StatsSink, TokenizerManager
from runtime.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
CHILDREN = ("scheduler", "detokenizer")


class LaunchError(RuntimeError):
    """A child failed to start or died; the message says which and why."""


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
        if main is not None and "__file__" in saved:
            del main.__file__
        if main is not None and "__spec__" in saved:
            main.__spec__ = None
        yield
    finally:
        for a, v in saved.items():
            setattr(main, a, v)


class ProcessGroup:
    """The scheduler and detokenizer processes of one launch."""

    def __init__(self, cfg: Config, scheduler_factory: str | None = None) -> None:
        """On node 0 of the tensor-parallel ranks (--node-rank 0): the scheduler, the detokenizer and this
        node's other ranks; on another node only that node's ranks (`runtime/executor/tp.py`)."""
        env = load_env()
        flat = cfg.to_dict()
        flat["model_path"] = resolve_model_path(cfg.model.model_path)
        par = cfg.parallel
        if par.tp_size > 1 and not flat["dist_init_addr"]:
            if par.nnodes > 1:
                raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, reachable by all)")
            flat["dist_init_addr"] = f"127.0.0.1:{_free_port()}"
        self.config = flat
        per_node = par.tp_size // par.nnodes
        ranks = range(par.node_rank * per_node, (par.node_rank + 1) * per_node)
        head = list(CHILDREN) if par.node_rank == 0 else []
        self.names = [*head, *(f"tp rank {r}" for r in ranks if r > 0)]
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
        from runtime.detokenizer.process import run_detokenizer_process
        from runtime.executor.tp_follower import run_tp_rank_process
        from runtime.scheduler.process import run_scheduler_process

        mp = multiprocessing.get_context("spawn")
        targets = {"scheduler": run_scheduler_process, "detokenizer": run_detokenizer_process}
        with _main_module_hidden():
            for name in self.names:
                if name in targets:
                    target, spec = targets[name], self._spec
                else:  # "tp rank r": a follower rank of the scheduler's model (runtime/executor/tp.py)
                    target, spec = run_tp_rank_process, {**self._spec, "tp_rank": int(name.rsplit(" ", 1)[1])}
                p = mp.Process(target=target, args=(spec,), name=f"radixgen-{name.replace(' ', '-')}")
                p.start()
                self.procs[name] = p
        atexit.register(self.shutdown)

    @property
    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.procs.items()}

    def wait_ready(self, timeout: float) -> ModelInfo:
        """Block until every child reports ready; the scheduler's ModelInfo. Raises LaunchError naming the
        failure (a child's startup error or exit, the timeout, or `shutdown` being called meanwhile)."""
        deadline = time.monotonic() + timeout
        infos: dict[str, ModelInfo | None] = {}
        with self._lock:
            if self._closing.is_set():
                raise LaunchError("shut down before the children were ready")
            self._waiting = True
        try:
            while len(infos) < len(self.names):
                msg = self._ready.recv(timeout_ms=100)
                if msg is not None:
                    if not msg.ok:
                        raise LaunchError(f"the {msg.name} process failed to start: {msg.error}")
                    infos[msg.name] = msg.model
                    continue
                if self._closing.is_set():
                    raise LaunchError("shut down before the children were ready")
                for name, p in self.procs.items():
                    if name not in infos and not p.is_alive():
                        raise LaunchError(f"the {name} process {describe_exit(p.exitcode)} while starting")
                if time.monotonic() > deadline:
                    missing = [n for n in self.names if n not in infos]
                    raise LaunchError(f"timed out after {timeout:g} s waiting for {', '.join(missing)} to start")
        finally:
            with self._lock:
                self._waiting = False
                self._close_ready()
        model = infos["scheduler"] if "scheduler" in infos else next(iter(infos.values()))
        if model is None:
            raise LaunchError("the scheduler reported ready without its model info")
        return model

    def _close_ready(self) -> None:
        """Close the ready socket and context (under _lock, never while wait_ready uses them)."""
        if not self._ready_closed:
            self._ready_closed = True
            self._ready.close()
            self._ctx.destroy(linger=0)

    def watch(self, on_death: Callable[[str], object]) -> None:
        """Call `on_death(reason)` once, from a thread, if a child exits while not shutting down."""
        def run() -> None:
            sentinels = {p.sentinel: name for name, p in self.procs.items()}
            ready = multiprocessing.connection.wait(list(sentinels))
            if self._closing.is_set():
                return
            name = sentinels[cast(int, ready[0])]  # wait() returns the sentinels it was given
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


class Launch:
    """One launch of the runtime: the config resolved once, the child processes, the tokenizer, and then the
    TokenizerManager. `runtime.Engine` and `radixgen serve` both go through it:
        launch = Launch(cfg); launch.start(); tokenizer, model = launch.wait_ready()  # blocking
        tm = launch.tokenizer_manager(tokenizer, model, stats)  # on the event loop that will use it
        launch.watch(on_death) ... launch.shutdown()
    """

    def __init__(self, cfg: Config, scheduler_factory: str | None = None) -> None:
        if cfg.parallel.dp_size > 1:
            raise ValueError("--dp-size > 1 starts that many servers behind sglang-router: it is a `radixgen serve` "
                             "option; one launch (and runtime.Engine) is one scheduler group")
        self.cfg = resolve(cfg)
        self.env = load_env()
        self.group = ProcessGroup(self.cfg, scheduler_factory)

    @property
    def config(self) -> dict[str, Any]:
        """The resolved flat config the children run with (model_path resolved to a file)."""
        return self.group.config

    @property
    def model_path(self) -> str:
        return self.group.config["model_path"]

    def start(self) -> None:
        self.group.start()

    def wait_ready(self) -> tuple[Tokenizer, ModelInfo]:
        """Load the tokenizer in a daemon thread while the children load; (tokenizer, the scheduler's
        ModelInfo) once both are done. A failure of either raises (LaunchError for the children)."""
        from runtime.tokenizer.load import load_tokenizer

        box: list[Any] = []

        def load() -> None:
            try:
                box.append((True, load_tokenizer(self.cfg.model.tokenizer_path or self.model_path)))
            except BaseException as e:  # re-raised in the caller's thread
                box.append((False, e))

        loader = threading.Thread(target=load, name="tokenizer-load", daemon=True)
        loader.start()
        model = self.group.wait_ready(self.cfg.server.startup_timeout)
        loader.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value, model

    def tokenizer_manager(self, tokenizer: Tokenizer, model: ModelInfo, stats: StatsSink | None) -> TokenizerManager:
        """Build and start the TokenizerManager (call on the running event loop that will use it)."""
        tm = TokenizerManager(self.cfg, tokenizer, self.group.endpoints, model, stats,
                              self.env.abort_confirm_timeout)
        tm.start()
        return tm

    def watch(self, on_death: Callable[[str], object]) -> None:
        self.group.watch(on_death)

    def shutdown(self) -> None:
        self.group.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def become_subreaper() -> None:
    """Make orphaned descendants re-parent to this process (Linux PR_SET_CHILD_SUBREAPER), so
    `reap_children` can reap them. For a process that is only a supervisor (never a library's host)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0)


def reap_children() -> None:
    """Kill and wait for every remaining child of this process (orphaned grandchildren adopted through
    `become_subreaper`, multiprocessing's resource tracker). Call last, after `ProcessGroup.shutdown`."""
    me = str(os.getpid())
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        pids = _child_pids(me)  # zombies included: they are reaped below
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            reaped, _ = os.waitpid(-1, 0 if pids else os.WNOHANG)
        except ChildProcessError:
            return
        if reaped == 0:
            return
    logger.warning("children still running at exit: %s", _child_pids(me))


def _child_pids(ppid: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2:].split()[1] == ppid:
                out.append(int(entry))
    return out
