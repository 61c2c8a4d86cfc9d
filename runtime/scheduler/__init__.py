"""The scheduler package: `Scheduler` (the loop) and its small collaborators.

policy.py (waiting-queue order), prefill.py (admission, reservation, chunking), decode.py (decode slots,
eviction, retraction), process.py (after the forward: logprobs, sampling, finishing), finish.py (finish
checks), cache.py (rows, slots and the radix tree).
"""

from __future__ import annotations

from runtime.scheduler.scheduler import GrammarBackend, Runner, Scheduler

__all__ = ["GrammarBackend", "Runner", "Scheduler"]
