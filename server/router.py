"""sglang-router (PyPI `sglang-router`, a Rust router with a Python launcher) as radixgen starts it: where the
executable is, and its command line in front of a set of radixgen workers.

radixgen does not route requests itself: `--dp-size N` (server/dp.py) and the tests start this router in front
of N worker servers. Facts about sglang-router 0.3.2 this module relies on (checked by
tests/server/test_router.py): `sglang-router launch --worker-urls URL...` registers each worker once its
`/health` answers 200 (retrying with a growing back-off, so start it after the workers are ready), serves
`/generate`, `/v1/*`, `/health`, `/get_model_info`, `/workers`, `/get_loads` (each worker's `/get_load`) and
`/engine_metrics` (each worker's `/metrics`, labelled by `worker_addr`), and its own Prometheus metrics on a
second port (29000 unless told), which is why that port is always given here.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence

ROUTER_EXECUTABLE = "sglang-router"
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


class RouterNotFound(RuntimeError):
    """The sglang-router executable is missing; the message says how to get it."""


def find_router(explicit: str | None = None) -> str:
    """Path of the sglang-router executable: `explicit` if given (it must exist and be executable), else the
    one installed next to this Python (the same venv), else the one on PATH. Raises RouterNotFound."""
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise RouterNotFound(f"--router-binary {explicit!r} is not an executable file")
    beside = os.path.join(os.path.dirname(sys.executable), ROUTER_EXECUTABLE)
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(ROUTER_EXECUTABLE)
    if found:
        return found
    raise RouterNotFound(f"{ROUTER_EXECUTABLE} not found next to {sys.executable} nor on PATH: "
                         f"`pip install sglang-router` (or pass --router-binary PATH)")


def router_command(executable: str, host: str, port: int, worker_urls: Sequence[str], policy: str,
                   prometheus_port: int, log_level: str = "warn", health_check_interval: int = 60,
                   health_failure_threshold: int = 3) -> list[str]:
    """argv of `sglang-router launch` serving on host:port in front of `worker_urls` (its Prometheus
    exporter on 127.0.0.1:prometheus_port). A worker stops getting requests once `health_failure_threshold`
    health checks in a row (one every `health_check_interval` s) failed; until then the router answers the
    requests it sends there with 500 (it does not retry a refused connection on another worker)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown router policy {policy!r} (one of {', '.join(POLICIES)})")
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    level = {"warning": "warn", "critical": "error"}.get(log_level, log_level)
    return [executable, "launch", "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--log-level", level, "--health-check-interval-secs", str(health_check_interval),
            "--health-failure-threshold", str(health_failure_threshold)]
