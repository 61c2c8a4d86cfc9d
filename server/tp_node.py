"""`radixgen serve --tp-size N --nnodes K --node-rank R` with R > 0: a machine that only runs its share of the
tensor-parallel ranks (N/K follower processes, runtime/executor/tp_follower.py); node 0 serves HTTP.

Supervised like `radixgen serve`'s children (runtime/launch.py ProcessGroup): the process is a child
subreaper, prints `radixgen tp node R ready (ranks A-B)` once its ranks loaded and joined, and exits 1 naming
the rank when one dies (they die when node 0 stops: their broadcast fails), 0 on SIGTERM/SIGINT, leaving no
process behind.
"""

from __future__ import annotations

import logging
import signal
import threading

from runtime.config import Config, resolve
from runtime.launch import LaunchError, ProcessGroup, become_subreaper, reap_children

logger = logging.getLogger("radixgen.tp_node")


def run_tp_node(cfg: Config) -> int:
    logging.basicConfig(level=cfg.server.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        cfg = resolve(cfg)
        group = ProcessGroup(cfg)
    except (FileNotFoundError, ValueError) as e:
        logger.error("%s", e)
        return 1
    become_subreaper()
    done = threading.Event()
    reason: list[str] = []

    def on_signal(sig: int, frame: object) -> None:
        logger.info("%s received: shutting down", signal.Signals(sig).name)
        done.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    group.start()
    try:
        try:
            group.wait_ready(cfg.server.startup_timeout)
        except LaunchError as e:
            if done.is_set():
                return 0
            logger.error("startup failed: %s", e)
            return 1
        par = cfg.parallel
        per = par.tp_size // par.nnodes
        print(f"radixgen tp node {par.node_rank} ready (ranks {par.node_rank * per}-{(par.node_rank + 1) * per - 1})",
              flush=True)

        def on_death(why: str) -> None:
            reason.append(why)
            done.set()

        group.watch(on_death)
        while not done.wait(0.5):  # a timed wait lets the signal handler run
            pass
        if reason:
            logger.error("%s; stopping this node", reason[0])
            return 1
        return 0
    finally:
        group.shutdown()
        reap_children()
        for s, h in previous.items():
            signal.signal(s, h)
