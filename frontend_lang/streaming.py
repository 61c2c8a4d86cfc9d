"""`run(stream=True)` readers: deltas of the whole text or of one variable, sync and async.

The executor's worker sets `stream_text_event` after text grows and `stream_var_event[name]` after a
variable grows; a reader clears the event, reads what is new since its last position, and stops once
the producer is done (`is_finished` for the text, the variable's final event for a variable). Reading
the completion flag *before* the text guarantees the last delta is never lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any


def _wait_registered(ex: Any, var_name: str) -> bool:
    """The body registers a variable's event when it submits the gen; wait for that (or the end)."""
    while var_name not in ex.stream_var_event:
        if ex.is_finished:
            return False
        time.sleep(0.005)
    return True


def text_iter(ex: Any, var_name: str | None = None) -> Iterator[str]:
    if not ex.stream:
        ex.sync()
        yield ex.text_ if var_name is None else ex.get_var(var_name)
        return
    prev = 0
    if var_name is None:
        event = ex.stream_text_event
        while True:
            event.wait()
            event.clear()
            done = ex.is_finished
            out = ex.text_[prev:]
            prev += len(out)
            if out:
                yield out
            if done:
                return
    if not _wait_registered(ex, var_name):
        return
    event, final = ex.stream_var_event[var_name], ex.variable_event[var_name]
    while True:
        event.wait()
        event.clear()
        done = final.is_set()
        out = str(ex.variables.get(var_name, ""))[prev:]
        prev += len(out)
        if out:
            yield out
        if done:
            return


async def text_async_iter(ex: Any, var_name: str | None = None,
                          return_meta_data: bool = False) -> AsyncIterator[Any]:
    """Like text_iter; waits run in a thread so the event loop stays free."""
    loop = asyncio.get_running_loop()
    if not ex.stream:
        await loop.run_in_executor(None, ex.sync)
        yield ex.text_ if var_name is None else ex.get_var(var_name)
        return
    prev = 0
    if var_name is None:
        event, final = ex.stream_text_event, None
    else:
        if not await loop.run_in_executor(None, _wait_registered, ex, var_name):
            return
        event, final = ex.stream_var_event[var_name], ex.variable_event[var_name]
    while True:
        await loop.run_in_executor(None, event.wait)
        event.clear()
        done = ex.is_finished if final is None else final.is_set()
        source = ex.text_ if var_name is None else str(ex.variables.get(var_name, ""))
        out = source[prev:]
        prev += len(out)
        if out:
            if return_meta_data and var_name is not None:
                yield out, ex.meta_info.get(var_name)
            else:
                yield out
        if done:
            return
