"""The real scheduler with a failpoint, for the reliability tests: a server started with
RADIXGEN_SCHEDULER_FACTORY=tests.reliability.faulty_scheduler:create raises while processing output token
RADIXGEN_TEST_FAULT_AT (default 1) of the request whose rid is exactly RADIXGEN_TEST_FAULT_RID.
"""

from __future__ import annotations

import os

from runtime.config import Config
from runtime.messages import ModelInfo
from runtime.scheduler.process import create_scheduler
from runtime.scheduler.scheduler import Scheduler
from tests.runtime.scheduler.harness import inject_fault


def create(cfg: Config) -> tuple[Scheduler, ModelInfo]:
    sched, model = create_scheduler(cfg)
    inject_fault(sched, os.environ["RADIXGEN_TEST_FAULT_RID"], int(os.environ.get("RADIXGEN_TEST_FAULT_AT", "1")))
    return sched, model
