"""The seam between the interpreter and a model service.

The interpreter (`interpreter.StreamExecutor`) calls these hooks while executing a program; a backend
turns them into requests. `s` is the executor: backends read `s.text_` (the full prompt so far),
`s.messages_` (finished chat turns) and `s.cur_images`. Every hook runs on the program's worker thread;
a backend must be safe to call from many threads at once (run_batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from frontend_lang.chat_template import ChatTemplate, get_chat_template

if TYPE_CHECKING:
    from frontend_lang.choices import ChoicesDecision, ChoicesSamplingMethod
    from frontend_lang.ir import SamplingParams


class BaseBackend:
    supports_images = False

    def __init__(self) -> None:
        self.chat_template: ChatTemplate = get_chat_template("default")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # Prefix caching hints.
    def cache_prefix(self, prefix_str: str) -> None:
        pass

    def commit_lazy_operations(self, s: Any) -> None:
        pass

    # Program lifetime.
    def begin_program(self, s: Any) -> None:
        pass

    def end_program(self, s: Any) -> None:
        pass

    # Execution.
    def generate(self, s: Any, sampling_params: SamplingParams) -> tuple[str, dict]:
        raise NotImplementedError

    def generate_stream(self, s: Any, sampling_params: SamplingParams) -> Iterator[tuple[str, dict]]:
        raise NotImplementedError

    def select(self, s: Any, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise NotImplementedError

    def separate_reasoning(self, text: str, model_type: str) -> tuple[str, str]:
        """(reasoning, answer) of a finished output, by the server's reasoning parser `model_type`."""
        raise NotImplementedError(f"{type(self).__name__} cannot separate reasoning: use a RuntimeEndpoint")

    # Server control.
    def flush_cache(self) -> None:
        pass

    def get_server_info(self) -> dict:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
