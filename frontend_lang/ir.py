"""The program IR: the expression nodes a program appends to its state (`s += node`).

Data flow: `api.py` builds these nodes (`gen`, `select`, roles, ...); `interpreter.StreamExecutor` executes
them in order against a backend. Nodes are plain immutable descriptions; they hold no state of a run.
`SamplingParams` is the frontend's view of sampling: a run's defaults merged with a gen's explicit values,
turned into the native `/generate` dict (`to_native_kwargs`) or OpenAI request fields (`to_openai_kwargs`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

# dtype -> regex sent to the server (the server compiles it into a token mask). A number may end in a space or
# newline: that is how the model says "the number is over" (the gen's stop strings " " and "\n" then end it),
# since the grammar masks every other continuation and the model would otherwise append digits ("4" -> "4000").
REGEX_INT = r"[-+]?[0-9]+[ \n]?"
REGEX_FLOAT = r"[-+]?[0-9]+(\.[0-9]+)?[ \n]?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w ]*\""

_DTYPE_NAMES = {int: "int", "int": "int", float: "float", "float": "float", bool: "bool", "bool": "bool",
                str: "str", "str": "str", "string": "str"}


def dtype_name(dtype: Any) -> str | None:
    """Normalizes a gen dtype (`int`, `"int"`, ...) to one of int/float/bool/str; None stays None."""
    if dtype is None:
        return None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported gen dtype {dtype!r}: use int, float, bool or str")
    return _DTYPE_NAMES[dtype]


def dtype_regex(dtype: str) -> str:
    return {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}[dtype]


def convert_dtype(text: str, dtype: str | None) -> Any:
    """The Python value of a gen's text for its dtype (the text itself stays in the program's text)."""
    if dtype is None or dtype == "str":
        return text
    raw = text.strip()
    if dtype == "int":
        return int(raw)
    if dtype == "float":
        return float(raw)
    if raw not in ("True", "False"):
        raise ValueError(f"gen(dtype=bool) produced {text!r}, not True/False")
    return raw == "True"


# Sampling keys sent in every native request's `sampling_params` (None -> JSON null = server default).
NATIVE_SAMPLING_KEYS = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "regex",
    "json_schema",
)
# Top-level `/generate` fields carried by a gen (sent only when set).
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


@dataclasses.dataclass
class SamplingParams:
    """Sampling for one gen. In a gen node every field defaults to None ("inherit the run's default")."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    stop_regex: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None
    regex: str | None = None
    json_schema: str | None = None
    reasoning_parser: str | None = None  # set by separate_reasoning: the server applies a constraint after thinking

    def merged_over(self, defaults: SamplingParams) -> SamplingParams:
        """A copy of `defaults` with this object's non-None fields on top."""
        out = dataclasses.replace(defaults)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(out, f.name, value)
        out.stop = stop_list(out.stop)
        out.stop_token_ids = list(out.stop_token_ids or [])
        return out

    def to_native_kwargs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in NATIVE_SAMPLING_KEYS}

    def to_openai_kwargs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(standard OpenAI fields, extra body fields understood by SGLang-style servers)."""
        std: dict[str, Any] = {
            "max_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
        }
        if self.stop:
            std["stop"] = list(self.stop)
        extra = {"top_k": self.top_k, "min_p": self.min_p, "min_tokens": self.min_new_tokens,
                 "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
                 "stop_token_ids": list(self.stop_token_ids) if self.stop_token_ids else None,
                 "regex": self.regex}
        return ({k: v for k, v in std.items() if v is not None},
                {k: v for k, v in extra.items() if v is not None and v is not False})


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def run_defaults(**kw: Any) -> SamplingParams:
    """The run-level defaults, SGLang's values (`SglFunction.run`)."""
    base = SamplingParams(max_new_tokens=128, min_new_tokens=0, n=1, stop=[], stop_token_ids=[],
                          temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0,
                          presence_penalty=0.0, ignore_eos=False)
    return SamplingParams(**kw).merged_over(base)


class Expr:
    """Base of all nodes. `a + b` on nodes/strings builds an ExprList."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([as_expr(other), self])


def as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    if isinstance(x, (int, float, bool)):
        return Text(str(x))
    raise TypeError(f"cannot append {type(x).__name__} to a program state")


class Text(Expr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Text({self.value!r})"


class ExprList(Expr):
    def __init__(self, items: list[Expr]) -> None:
        flat: list[Expr] = []
        for it in items:
            flat.extend(it.items if isinstance(it, ExprList) else [it])
        self.items: list[Expr] = flat

    def __repr__(self) -> str:
        return f"ExprList({self.items!r})"


class Gen(Expr):
    def __init__(self, name: str | None, params: SamplingParams) -> None:
        self.name = name
        self.params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class Select(Expr):
    def __init__(self, name: str | None, choices: list[str], temperature: float,
                 choices_method: Callable[..., Any]) -> None:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("select needs a non-empty list of string choices")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, {self.choices!r})"


class SeparateReasoning(Expr):
    """After `expr` (a named gen or select) ran: split its variable into the answer (kept under its name) and the
    thinking (`<name>_reasoning_content`), with the server's reasoning parser `model_type` (SGLang's API)."""

    def __init__(self, model_type: str, expr: Expr) -> None:
        target = next((e for e in _flatten(expr) if isinstance(e, (Gen, Select)) and e.name), None)
        if target is None:
            raise ValueError("separate_reasoning needs a named gen or select")
        assert target.name is not None
        self.model_type, self.expr, self.target = model_type, expr, target.name
        self.name = f"{target.name}_reasoning_content"
        if isinstance(target, Gen):
            target.params.reasoning_parser = model_type  # its constraint applies after the thinking

    def __repr__(self) -> str:
        return f"SeparateReasoning({self.model_type!r}, {self.target!r})"


def _flatten(expr: Expr) -> list[Expr]:
    return [x for e in expr.items for x in _flatten(e)] if isinstance(expr, ExprList) else [expr]


class RoleBegin(Expr):
    def __init__(self, role: str) -> None:
        self.role = role


class RoleEnd(Expr):
    def __init__(self, role: str) -> None:
        self.role = role


class Image(Expr):
    def __init__(self, path: str) -> None:
        self.path = path


class VarScopeBegin(Expr):
    def __init__(self, name: str) -> None:
        self.name = name


class VarScopeEnd(Expr):
    def __init__(self, name: str) -> None:
        self.name = name


class CommitLazy(Expr):
    """Send the text so far to the backend (prefill only) so forks share its cached prefix."""


def json_schema_text(schema: Any) -> str | None:
    """gen(json_schema=...) takes a JSON string or a dict; the wire carries a string."""
    if schema is None or isinstance(schema, str):
        return schema
    return json.dumps(schema)


def output_names(expr: Expr) -> list[str]:
    """Variables an expression will produce (the interpreter makes their events before running it)."""
    if isinstance(expr, (Gen, Select)) and expr.name is not None:
        return [expr.name]
    if isinstance(expr, (VarScopeBegin, SeparateReasoning)):
        return [expr.name]
    if isinstance(expr, ExprList):
        return [n for e in expr.items for n in output_names(e)]
    return []
