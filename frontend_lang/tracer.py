"""Find a program's constant prefix by running it on placeholder arguments.

The body runs on a synchronous executor whose backend refuses to generate, with arguments that refuse
every use (`str()`, `+`, `bool()`, formatting, attribute access). Everything appended before the first
gen/select/argument use cannot depend on the arguments, so it is the prefix every call of the program
shares: `run_batch` sends it once (`cache_prefix`) so the batch finds it in the server's radix cache.
"""

from __future__ import annotations

import contextlib
from typing import Any

from frontend_lang import ir
from frontend_lang.backend.base import BaseBackend


class StopTracing(Exception):
    pass


class _Placeholder:
    """An argument during tracing: any use of it ends the constant prefix."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _stop(self, *args: Any, **kwargs: Any) -> Any:
        raise StopTracing(object.__getattribute__(self, "_name"))

    __str__ = __format__ = __add__ = __radd__ = __bool__ = __len__ = __iter__ = _stop
    __getitem__ = __contains__ = __eq__ = __lt__ = __gt__ = __int__ = __float__ = __call__ = _stop
    __mul__ = __rmul__ = __mod__ = __rmod__ = _stop
    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, item: str) -> Any:
        raise StopTracing(item)


class _TracingBackend(BaseBackend):
    def __init__(self, real: Any) -> None:
        super().__init__()
        self.chat_template = real.get_chat_template()
        self.supports_images = getattr(real, "supports_images", False)

    def generate(self, s: Any, sampling_params: Any) -> Any:
        raise StopTracing("gen")

    def generate_stream(self, s: Any, sampling_params: Any) -> Any:
        raise StopTracing("gen")

    def select(self, s: Any, choices: Any, temperature: Any, choices_method: Any) -> Any:
        raise StopTracing("select")


def extract_prefix_by_tracing(program: Any, backend: Any) -> str:
    from frontend_lang.interpreter import StreamExecutor
    from frontend_lang.program_state import ProgramState

    args = {name: _Placeholder(name) for name in program.arg_names}
    args.update(program.bind_arguments)
    ex = StreamExecutor(_TracingBackend(backend), args, ir.run_defaults(), use_thread=False)
    state = ProgramState(ex)
    with contextlib.suppress(Exception):  # any failure just ends the traced prefix
        program.func(state, **args)
    ex.end()
    return ex.text_
