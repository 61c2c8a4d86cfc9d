"""The common body of a child process (scheduler, detokenizer): set up, build, report ready, run.

The parent (runtime/launch.py) spawns each child with a plain dict `spec` (flat config, endpoints, parent
pid). The child names itself, ignores SIGINT (the parent handles Ctrl-C for the group), dies with its parent
(PR_SET_PDEATHSIG plus a parent-pid poll), builds its loop, sends one `ReadyMsg` (ok, or the error), then
runs the loop until it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from runtime.config import Config, make_config  # the parent resolved the config once
from runtime.ipc import Sender
from runtime.messages import ReadyMsg

logger = logging.getLogger(__name__)


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


def start_child(spec: dict, name: str, build: Callable[[Config, zmq.Context, dict], Any]) -> None:
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
    ready.send(ReadyMsg(name=name, ok=True, model=loop.model))
    ready.close(linger_ms=-1)  # deliver it whenever the parent listens (the parent watch ends us if it is gone)
    # Everything built so far lives as long as the process. A loaded and compiled model leaves ~750k objects
    # the cyclic GC tracks, and one full collection over them stalls the loop ~400 ms (2 cores); frozen, they
    # are never scanned again, so requests' garbage is collected at its own small cost.
    gc.collect()
    gc.freeze()
    loop.run()
    os._exit(0)
