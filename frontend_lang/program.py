"""`@function` programs and how they run: one state (`run`) or many on a thread pool (`run_batch`).

A program is a Python function whose first parameter is the state `s`. `run` makes a StreamExecutor,
calls the body (which only submits nodes), ends the executor and returns the ProgramState; with
`stream=True` the body runs on its own thread and `run` returns at once. `run_batch` first pre-caches
the program's traced constant prefix (so every item hits the radix cache), then runs the items on a
thread pool; a failure in one item is kept in that item's `s.error()` and never affects the others.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from frontend_lang import ir
from frontend_lang.global_config import global_config
from frontend_lang.interpreter import StreamExecutor
from frontend_lang.program_state import ProgramState
from frontend_lang.tracer import extract_prefix_by_tracing

_RUN_KEYS = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
)


class Function:
    """What `@function` returns. Call `.run(...)`, `.run_batch([...])`, or `.bind(...)`."""

    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise TypeError(f"the first parameter of @function {func.__name__} must be named 's'")
        self.arg_names = [p for p in params[1:] if p not in self.bind_arguments]

    def bind(self, **kwargs: Any) -> Function:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"bind(): {self.func.__name__} has no parameters {sorted(unknown)}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _split(self, kwargs: dict) -> tuple[ir.SamplingParams, dict]:
        # A program parameter with a sampling key's name stays the program's argument.
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_KEYS and k not in self.arg_names}
        if "max_tokens" in kwargs and "max_tokens" not in self.arg_names:
            sampling["max_new_tokens"] = kwargs.pop("max_tokens")
        return ir.run_defaults(**sampling), kwargs

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        defaults, kwargs = self._split(kwargs)
        return run_program(self, resolve_backend(backend), args, kwargs, defaults, stream)

    def run_batch(self, batch_kwargs: Sequence[dict | Sequence], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, **kwargs: Any) -> list[ProgramState]:
        defaults, extra = self._split(dict(kwargs))
        if extra:
            raise TypeError(f"run_batch(): unknown arguments {sorted(extra)}")
        return run_program_batch(self, resolve_backend(backend), list(batch_kwargs), defaults,
                                 num_threads, progress_bar)

    def trace_prefix(self, backend: Any = None) -> str:
        return extract_prefix_by_tracing(self, resolve_backend(backend))

    def cache(self, backend: Any = None) -> str:
        """Send the constant prefix to the backend now; returns it ('' if too short to bother)."""
        return cache_program(self, resolve_backend(backend))

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def resolve_backend(backend: Any) -> Any:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url))")
    return getattr(backend, "endpoint", backend)  # a Runtime stands for its endpoint


def cache_program(program: Function, backend: Any) -> str:
    prefix = extract_prefix_by_tracing(program, backend)
    if len(prefix) > global_config.precache_min_chars:
        backend.cache_prefix(prefix)
        return prefix
    return ""


def _body(state: ProgramState, program: Function, args: tuple, kwargs: dict, capture: bool) -> None:
    ex = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **{**kwargs, **program.bind_arguments})
    except Exception as e:
        if not capture:
            raise
        ex.sync()
        if ex.error_ is None:
            ex.error_ = e
    finally:
        ex.end()
    ex.sync()
    if global_config.verbosity >= 2:
        print(ex.text_)


def run_program(program: Function, backend: Any, args: tuple, kwargs: dict,
                defaults: ir.SamplingParams, stream: bool, capture: bool = False) -> ProgramState:
    state = ProgramState(StreamExecutor(backend, dict(kwargs), defaults, stream=stream))
    if stream:
        threading.Thread(target=_body, args=(state, program, args, kwargs, True), daemon=True).start()
    else:
        _body(state, program, args, kwargs, capture)
    return state


def _auto_threads() -> int:
    return max(96, 16 * (os.cpu_count() or 1))


def run_program_batch(program: Function, backend: Any, batch: list, defaults: ir.SamplingParams,
                      num_threads: int | str, progress_bar: bool) -> list[ProgramState]:
    if not batch:
        return []
    if global_config.enable_precache_with_tracing and len(batch) > 1:
        cache_program(program, backend)
    threads = _auto_threads() if num_threads == "auto" else int(num_threads)
    threads = max(1, min(threads, len(batch)))

    def one(item: dict | Sequence) -> ProgramState:
        args, kwargs = ((), dict(item)) if isinstance(item, dict) else (tuple(item), {})
        return run_program(program, backend, args, kwargs, defaults, stream=False, capture=True)

    bar = _progress(len(batch)) if progress_bar else None
    results: list[ProgramState | None] = [None] * len(batch)
    with ThreadPoolExecutor(threads) as pool:
        futures = {pool.submit(one, item): i for i, item in enumerate(batch)}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return results  # type: ignore[return-value]


def _progress(total: int) -> Any:
    from tqdm import tqdm  # lazily: only a batch with a progress bar needs it

    return tqdm(total=total, desc="run_batch")
