"""radixgen's frontend language: SGLang's prompt-programming DSL over HTTP.

    import frontend_lang as fl

    @fl.function
    def qa(s, question):
        s += fl.user(question)
        s += fl.assistant(fl.gen("answer", max_tokens=32))

    fl.set_default_backend(fl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is 2+2?")["answer"])

Only the standard library and httpx: never imports `runtime`, `server` or `kernels`.
"""

from __future__ import annotations

from frontend_lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from frontend_lang.backend.base import BaseBackend
from frontend_lang.backend.http import BackendError, GenerationAborted
from frontend_lang.backend.openai import OpenAI
from frontend_lang.backend.runtime import Runtime
from frontend_lang.backend.runtime_endpoint import RuntimeEndpoint
from frontend_lang.chat_template import (
    ChatTemplate,
    get_chat_template,
    get_chat_template_by_model_path,
    register_chat_template,
    register_chat_template_matching_function,
)
from frontend_lang.choices import (
    ChoicesDecision,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from frontend_lang.global_config import global_config
from frontend_lang.program import Function
from frontend_lang.program_state import ProgramState, ProgramStateGroup

__version__ = "0.1.0"

__all__ = [
    "BackendError", "BaseBackend", "GenerationAborted", "ChatTemplate", "ChoicesDecision", "Function", "OpenAI", "ProgramState",
    "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_chat_template",
    "get_chat_template_by_model_path", "get_server_info", "global_config", "greedy_token_selection", "image",
    "register_chat_template", "register_chat_template_matching_function", "select", "separate_reasoning",
    "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end",
]
