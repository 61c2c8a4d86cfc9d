"""The scheduler package: `Scheduler` (the loop) and its small collaborators.

policy.py (waiting-queue order), prefill.py (admission, reservation, chunking), decode.py (decode slots,
eviction, retraction), output.py (after the forward: logprobs, sampling, finishing), finish.py (finish
checks), cache.py (rows, slots and the radix tree), speculative.py and draft.py (speculative decoding),
process.py (the scheduler process and its loop).
"""

from __future__ import annotations

from runtime.scheduler.scheduler import Runner, Scheduler

__all__ = ["Runner", "Scheduler"]
