"""Request-body validation shared by /v1/chat/completions and /v1/completions, and the mapping of OpenAI
parameters onto radixgen's sampling params.

Every failure is a `RequestError` (400) naming the parameter as a JSON path (`param`) with OpenAI's codes:
`invalid_type`, `missing_required_parameter`, `empty_array`, `integer_below_min_value`,
`integer_above_max_value`, `decimal_below_min_value`, `decimal_above_max_value`, `invalid_value`.
`null` always means "the default". Top-level fields: each route lists what it serves (its `KNOWN`); besides those,
`INFORMATIONAL` and `SGLANG_ACCEPTED` below are accepted, `ONLY_AT` fields pass only at the values listed, and
anything else is a 400 `unsupported_parameter` naming the field (docs/protocol.md lists all of them).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema

from runtime.config import ServerConfig
from runtime.constrained.json_rules import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, nesting_depth
from runtime.tokenizer.generate_input import RequestError, is_int

INT64_MAX = 2**63 - 1
# response_format json_object: any JSON object whose values are scalars, arrays of scalars or objects of
# scalars. The unrestricted `{"type": "object"}` compiles to a ~6k-character regex whose index takes ~10 s
# on SmolLM2's vocabulary (past the 5 s compile limit); this one takes under a second.
_SCALAR = {"type": ["string", "number", "boolean", "null"]}
JSON_OBJECT_SCHEMA = json.dumps({"type": "object", "additionalProperties": {"anyOf": [
    _SCALAR, {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]}},
    separators=(",", ":"))

# Informational by OpenAI's own definition (they label or route a request, never change its output): accepted.
INFORMATIONAL = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})
# SGLang's own request fields that sglang-router fills in on every chat request (true by default); the chat
# route reads them (server/openai/reasoning.py), other routes accept them.
SGLANG_ACCEPTED = frozenset({"separate_reasoning", "stream_reasoning"})
# Fields accepted only at the values radixgen serves (null always passes): field -> (values, what else means).
ONLY_AT: dict[str, tuple[tuple[Any, ...], str]] = {
    "modalities": ((["text"],), "only [\"text\"] is supported"),
    "audio": ((), "audio output is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "service_tier": (("auto", "default", "standard_only"), "only the standard tier exists (auto, default, standard_only)"),
    "reasoning_effort": ((), "this model has no reasoning mode"),
    "verbosity": (("medium",), "only 'medium' is supported"),
    "return_hidden_states": ((False,), "returning hidden states is not supported"),
}
ACCEPTED = INFORMATIONAL | SGLANG_ACCEPTED | frozenset(ONLY_AT)


def refuse_unsupported(data: dict[str, Any], known: frozenset[str] = ACCEPTED) -> None:
    """A 400 naming the first field that is neither in `known` nor accepted here, or an `ONLY_AT` field asking for
    what radixgen does not serve (audio output, web search, a modality but text, another service tier, ...)."""
    unknown = sorted(k for k in data if k not in known and k not in ACCEPTED)
    if unknown:
        raise RequestError(f"unsupported parameter(s): {', '.join(unknown)}"[:300], unknown[0],
                           "unsupported_parameter")
    for key, (values, why) in ONLY_AT.items():
        v = data.get(key)
        if v is not None and not any(type(v) is type(ok) and v == ok for ok in values):
            raise RequestError(f"'{key}': {why}, got {v!r}"[:300], key, "unsupported_parameter")


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _type_name(x: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(x), "a number")


class Body:
    """A decoded JSON request object with typed getters that raise RequestError naming the parameter."""

    def __init__(self, data: Any, known: frozenset[str]) -> None:
        if not isinstance(data, dict):
            raise RequestError(f"the request body must be a JSON object, got {_type_name(data)}", None,
                               "invalid_type")
        self.data = data
        refuse_unsupported(data, known)

    def raw(self, key: str) -> Any:
        return self.data.get(key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def boolean(self, key: str, default: bool = False) -> bool:
        v = self.data.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise RequestError(f"'{key}' must be a boolean, got {_type_name(v)}", key, "invalid_type")
        return v

    def string(self, key: str) -> str | None:
        v = self.data.get(key)
        if v is not None and not isinstance(v, str):
            raise RequestError(f"'{key}' must be a string, got {_type_name(v)}", key, "invalid_type")
        return v

    def integer(self, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.data.get(key)
        if v is None:
            return None
        if not is_int(v):
            raise RequestError(f"'{key}' must be an integer, got {v!r}"[:200], key, "invalid_type")
        if lo is not None and v < lo:
            raise RequestError(f"'{key}' must be at least {lo}, got {v}", key, "integer_below_min_value")
        if hi is not None and v > hi:
            raise RequestError(f"'{key}' must be at most {hi}, got {v}", key, "integer_above_max_value")
        return v

    def number(self, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
        """A finite number in [lo, hi] (or (lo, hi] with `lo_open`)."""
        v = self.data.get(key)
        if v is None:
            return None
        if not _is_num(v):
            raise RequestError(f"'{key}' must be a number, got {_type_name(v)}", key, "invalid_type")
        if not math.isfinite(v):
            raise RequestError(f"'{key}' must be a finite number", key, "invalid_value")
        bracket = "(" if lo_open else "["
        if v < lo or (lo_open and v == lo):
            raise RequestError(f"'{key}' must be in {bracket}{lo:g}, {hi:g}], got {v:g}", key,
                               "decimal_below_min_value")
        if v > hi:
            raise RequestError(f"'{key}' must be in {bracket}{lo:g}, {hi:g}], got {v:g}", key,
                               "decimal_above_max_value")
        return float(v)


def sampling_params(body: Body, srv: ServerConfig, vocab_size: int) -> dict[str, Any]:
    """The sampling params both routes share (everything but max tokens, n and constraints)."""
    sp: dict[str, Any] = {}
    for key, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                                 ("min_p", 0.0, 1.0, False), ("presence_penalty", -2.0, 2.0, False),
                                 ("frequency_penalty", -2.0, 2.0, False),
                                 ("repetition_penalty", 0.0, 2.0, True)):
        v = body.number(key, lo, hi, lo_open)
        if v is not None:
            sp[key] = v
    top_k = body.integer("top_k", -1)
    if top_k is not None:
        sp["top_k"] = -1 if top_k == 0 else top_k
    seed = body.integer("seed", -INT64_MAX, INT64_MAX - srv.max_n)
    if seed is not None:
        sp["sampling_seed"] = seed
    min_tokens = body.integer("min_tokens", 0)
    if min_tokens:
        sp["min_new_tokens"] = min_tokens
    stop = stop_strings(body.raw("stop"), srv)
    if stop:
        sp["stop"] = stop
    ids = body.raw("stop_token_ids")
    if ids is not None:
        if not (isinstance(ids, list) and all(is_int(t) and 0 <= t < vocab_size for t in ids)):
            raise RequestError(f"'stop_token_ids' must be a list of token ids in [0, {vocab_size})",
                               "stop_token_ids", "invalid_value")
        sp["stop_token_ids"] = ids
    for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if body.has(key):
            sp[key] = body.boolean(key)
    bias = logit_bias(body.raw("logit_bias"), vocab_size)
    if bias:
        sp["logit_bias"] = bias
    return sp


def stop_strings(v: Any, srv: ServerConfig, param: str = "stop") -> list[str]:
    """Stop strings from a string or a list of strings, bounded in count and length; errors name `param`."""
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"'{param}' must be a string or a list of strings", param, "invalid_type")
    if len(stops) > srv.max_stop_strings:
        raise RequestError(f"'{param}' may hold at most {srv.max_stop_strings} strings, got {len(stops)}", param,
                           "invalid_value")
    for s in stops:
        if s == "":
            raise RequestError(f"'{param}' cannot contain an empty string", param, "invalid_value")
        if len(s) > srv.max_stop_string_len:
            raise RequestError(f"each stop string may have at most {srv.max_stop_string_len} characters", param,
                               "invalid_value")
    return stops


def logit_bias(v: Any, vocab_size: int) -> dict[str, float] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to biases", "logit_bias",
                           "invalid_type")
    out: dict[str, float] = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit()) or not 0 <= int(key) < vocab_size:
            raise RequestError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}"[:200],
                               "logit_bias", "invalid_value")
        if not _is_num(bias) or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise RequestError(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}"[:200],
                               "logit_bias", "invalid_value")
        out[str(int(key))] = float(bias)
    return out


def priority(body: Body) -> int | None:
    """`priority` (an integer; larger runs first unless the server says otherwise; docs/protocol.md)."""
    return body.integer("priority", -INT64_MAX, INT64_MAX)


def prediction(body: Body) -> str | None:
    """The text of OpenAI's `prediction` ({"type": "content", "content": a string or text parts})."""
    v = body.raw("prediction")
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") != "content":
        raise RequestError("'prediction' must be {\"type\": \"content\", \"content\": ...}", "prediction",
                           "invalid_value")
    content = v.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError("'prediction.content' must be a string or a list of text parts", "prediction.content",
                       "invalid_type")


def max_tokens(body: Body, keys: tuple[str, ...]) -> tuple[int | None, str]:
    """The first of `keys` given (e.g. max_completion_tokens before max_tokens), at least 1; and its name."""
    for key in keys:
        v = body.integer(key, 1)
        if v is not None:
            return v, key
    return None, keys[-1]


def n_choices(body: Body, srv: ServerConfig) -> int:
    return body.integer("n", 1, srv.max_n) or 1


def stream_options(body: Body, stream: bool) -> bool:
    """include_usage from stream_options (400 without stream=true, as OpenAI and vLLM)."""
    opts = body.raw("stream_options")
    if opts is None:
        return False
    if not stream:
        raise RequestError("'stream_options' can only be given when 'stream' is true", "stream_options",
                           "invalid_value")
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", "stream_options", "invalid_type")
    v = opts.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean", "stream_options.include_usage",
                           "invalid_type")
    return bool(v)


# ---------------------------------------------------------------- constraints


def check_schema(schema: Any, param: str) -> str:
    """A JSON schema as compact text, after checking it is a valid schema of bounded size and depth."""
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"'{param}' must be a JSON schema object", param, "invalid_type")
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_BYTES:
        raise RequestError(f"'{param}' is larger than {MAX_SCHEMA_BYTES} bytes", param, "invalid_value")
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:  # the runtime's own limits (json_rules)
        raise RequestError(f"'{param}' is nested deeper than {MAX_SCHEMA_DEPTH}", param, "grammar_too_complex")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise RequestError(f"'{param}' is not a valid JSON schema: {e.message} (at '{where}')"[:500], param,
                           "invalid_value") from None
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestError(f"'{param}' is not a valid JSON schema: {e}"[:500], param, "invalid_value") from None
    return text


def response_format_schema(v: Any) -> str | None:
    """The json_schema constraint text for `response_format` (None for text / absent)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise RequestError("'response_format' must be an object", "response_format", "invalid_type")
    kind = v.get("type")
    if kind is None:
        raise RequestError("'response_format.type' is required", "response_format.type",
                           "missing_required_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise RequestError(f"'response_format.type' must be text, json_object, json_schema or structural_tag, got "
                           f"{kind!r}"[:200],
                           "response_format.type", "invalid_value")
    spec = v.get("json_schema")
    if spec is None and "schema" in v:  # a bare top-level schema (SGLang accepts it)
        spec = {"schema": v["schema"]}
    if spec is None:
        raise RequestError("the 'json_schema' field must be provided when response_format.type is json_schema",
                           "response_format.json_schema", "missing_required_parameter")
    if not isinstance(spec, dict):
        raise RequestError("'response_format.json_schema' must be an object", "response_format.json_schema",
                           "invalid_type")
    for key, kind_ok in (("name", str), ("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_ok):
            raise RequestError(f"'response_format.json_schema.{key}' has the wrong type",
                               f"response_format.json_schema.{key}", "invalid_type")
    schema = spec.get("schema")
    if schema is None:  # an unrestricted object would be a ~10 s compile that then times out: ask for one
        raise RequestError("'response_format.json_schema.schema' is required: the JSON schema to follow (for any "
                           "JSON object use response_format.type json_object)", "response_format.json_schema.schema",
                           "missing_required_parameter")
    return check_schema(schema, "response_format.json_schema.schema")


def structural_tag_spec(rf: dict[str, Any]) -> str:
    """SGLang's `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}` as the
    structural_tag constraint text (its shape is checked by the grammar backend, naming the problem)."""
    extra = sorted(set(rf) - {"type", "structures", "triggers"})
    if extra:
        raise RequestError(f"'response_format' of type structural_tag takes structures and triggers, not {extra}"
                           [:200], f"response_format.{extra[0]}", "unsupported_parameter")
    for key in ("structures", "triggers"):
        if not isinstance(rf.get(key), list):
            raise RequestError(f"'response_format.{key}' must be an array", f"response_format.{key}",
                               "missing_required_parameter" if rf.get(key) is None else "invalid_type")
    for i, st in enumerate(rf["structures"]):
        if isinstance(st, dict) and st.get("schema") is not None:
            check_schema(st["schema"], f"response_format.structures[{i}].schema")
    return json.dumps({"structures": rf["structures"], "triggers": rf["triggers"]}, separators=(",", ":"))


def constraint(body: Body, srv_json_schema: str | None = None) -> tuple[dict[str, str], str | None]:
    """At most one of response_format / json_schema / regex / ebnf, as a sampling-params entry, and the
    request parameter it came from (for errors)."""
    found: dict[str, tuple[str, str]] = {}  # param name -> (sampling key, value)
    rf_raw = body.raw("response_format")
    if isinstance(rf_raw, dict) and rf_raw.get("type") == "structural_tag":
        found["response_format"] = ("structural_tag", structural_tag_spec(rf_raw))
    else:
        rf = response_format_schema(rf_raw)
        if rf is not None:
            found["response_format"] = ("json_schema", rf)
    if srv_json_schema is not None:
        found["json_schema"] = ("json_schema", srv_json_schema)
    regex = body.string("regex")
    if regex is not None:
        try:
            re.compile(regex)
        except (re.error, RecursionError, OverflowError) as e:
            raise RequestError(f"'regex' is not a valid regular expression: {e}"[:300], "regex",
                               "invalid_value") from None
        found["regex"] = ("regex", regex)
    ebnf = body.string("ebnf")
    if ebnf is not None:
        found["ebnf"] = ("ebnf", ebnf)
    if len(found) > 1:
        names = ", ".join(found)
        raise RequestError(f"give at most one of response_format, json_schema, regex and ebnf (got {names})",
                           next(iter(found)), "invalid_value")
    for param, (key, value) in found.items():
        return {key: value}, param
    return {}, None
