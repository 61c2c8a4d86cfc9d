"""The public constructors: `function`, `gen`, `select`, roles, `image`, `set_default_backend`.

Each returns an IR node (ir.py) for `s += ...`; nothing here talks to a backend except the small server
helpers at the bottom, which use the default backend.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from frontend_lang import ir
from frontend_lang.choices import ChoicesSamplingMethod, token_length_normalized
from frontend_lang.global_config import global_config
from frontend_lang.program import Function


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """`@function` or `@function(num_api_spec_tokens=N)` turns a body `def f(s, ...)` into a program."""
    if func is not None:
        return Function(func, num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_regex: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: Any = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    repetition_penalty: float | None = None,
) -> ir.Expr:
    """Generate text into `s[name]`. Unset arguments inherit the run's defaults.

    `choices` makes it a `select`; `dtype` (int/float/bool/str) constrains the output by a regex and
    converts `s[name]`; `regex` and `json_schema` (dict or JSON string) constrain decoding on the server.
    """
    if choices is not None:
        return ir.Select(name, list(choices), 0.0 if temperature is None else temperature,
                         choices_method or token_length_normalized)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen(regex=...) is not a valid regular expression: {e}") from e
    params = ir.SamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=ir.dtype_name(dtype), regex=regex,
        json_schema=ir.json_schema_text(json_schema))
    return ir.Gen(name, params)


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ir.Expr:
    """SGLang's `separate_reasoning(gen("answer", ...), model_type="deepseek-r1")`: after the gen, `s["answer"]`
    holds the answer and `s["answer_reasoning_content"]` the thinking, split by the server's reasoning parser
    `model_type` (POST /separate_reasoning); a constraint on the gen (regex, json_schema) applies only after the
    thinking. Needs a RuntimeEndpoint backend."""
    if expr is None or model_type is None:
        raise ValueError("separate_reasoning needs an expression (a named gen) and a model_type")
    inner = ir.as_expr(expr)
    return ir.ExprList([inner, ir.SeparateReasoning(model_type, inner)])


def gen_int(name: str | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> ir.Expr:
    """Append the most likely of `choices` (scored by the backend's logprobs) and store it in `s[name]`."""
    if choices is None:
        raise ValueError("select() needs choices")
    if temperature > 1e-5:
        raise ValueError("select() scores choices greedily: temperature must be 0")
    return ir.Select(name, list(choices), temperature, choices_method)


def image(path: str) -> ir.Expr:
    return ir.Image(path)


def _role(role: str, expr: Any) -> ir.Expr:
    if expr is None:
        return ir.ExprList([ir.RoleBegin(role), ir.RoleEnd(role)])
    return ir.ExprList([ir.RoleBegin(role), ir.as_expr(expr), ir.RoleEnd(role)])


def system(expr: Any = None) -> ir.Expr:
    return _role("system", expr)


def user(expr: Any = None) -> ir.Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    return _role("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")


def set_default_backend(backend: Any) -> None:
    global_config.default_backend = backend


def _default_backend(backend: Any) -> Any:
    from frontend_lang.program import resolve_backend
    return resolve_backend(backend)


def flush_cache(backend: Any = None) -> None:
    _default_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict:
    return _default_backend(backend).get_server_info()
