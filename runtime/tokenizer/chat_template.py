"""Chat templates: Jinja rendering the way Hugging Face does it, built-in templates, and control-token marking.

Data flow: the OpenAI layer (or the tokenizer's `apply_chat_template`) hands `render_chat_template` a template
string (the model's own, or one picked by `resolve_chat_template` for `--chat-template`) and the request's
messages/tools; the rendered prompt goes to the tokenizer.

Rendering matches `transformers`' `apply_chat_template(..., tokenize=False)`: jinja2's
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`{% generation %}` block that just renders its body, a `tojson` filter that does not HTML-escape, and the globals
`raise_exception` and `strftime_now`. Template inputs are rebuilt from plain JSON types first (the sandbox only
protects against attribute access on objects it knows about).

Control-token marking (`mark_control_text` / `split_marked`): to keep a user from forging control tokens by
typing their text, every control-token string inside user-supplied strings is wrapped in a private-use marker
before rendering; after rendering, the marked spans are known to be user text. See `Tokenizer.encode_chat`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ---------------------------------------------------------------- built-in templates (for --chat-template NAME)

_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Llama 2 chat: the system prompt goes inside the first [INST] block.
_LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}"
    "{{ bos_token + '[INST] <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% else %}{{ raise_exception('llama2 template: roles are system, user, assistant') }}{% endif %}"
    "{% endfor %}"
)

# Mistral instruct: no system role; a system prompt is prepended to the first user turn.
_MISTRAL = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first %}{{ '[INST] ' + system + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('mistral template: roles are system, user, assistant') }}{% endif %}"
    "{% endfor %}"
)

# Gemma: roles user/model; a system prompt is prepended to the first user turn.
_GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] | trim + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% set prefix = system if loop.first else '' %}"
    "{{ '<start_of_turn>' + role + '\\n' + prefix + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama3": _LLAMA3,
    "llama2": _LLAMA2,
    "mistral": _MISTRAL,
    "gemma": _GEMMA,
}


def resolve_chat_template(name_or_path: str | None, default: str | None) -> str | None:
    """The template text for `--chat-template`: None -> `default` (the model's own template); a built-in name
    (`BUILTIN_TEMPLATES`); a file path (a `.jinja` text file, or a JSON file with a `chat_template` key such as a
    tokenizer_config.json); or a literal Jinja template string. Anything else raises ValueError."""
    if name_or_path is None:
        return default
    if name_or_path in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name_or_path]
    if os.path.isfile(name_or_path):
        with open(name_or_path, encoding="utf-8") as f:
            text = f.read()
        if name_or_path.endswith(".json"):
            return template_from_config(json.loads(text))
        return text
    if "{{" in name_or_path or "{%" in name_or_path:
        return name_or_path
    raise ValueError(
        f"--chat-template {name_or_path!r} is neither a built-in template ({', '.join(sorted(BUILTIN_TEMPLATES))}),"
        " a file, nor a Jinja template"
    )


def template_from_config(config: Mapping[str, Any]) -> str | None:
    """The default chat template in a tokenizer_config.json-style dict: a string, or a list of
    `{"name", "template"}` entries (the one named "default" wins, else the first)."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    named = {entry["name"]: entry["template"] for entry in value}
    if "default" in named:
        return named["default"]
    return next(iter(named.values()), None)


# ---------------------------------------------------------------- rendering


class TemplateError(ValueError):
    """A chat template rejected its input (its `raise_exception`) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by HF templates to mark assistant spans): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; HF templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def plain_data(value: Any) -> Any:
    """A deep copy built only from JSON types (str, int, float, bool, None, dict, list), so the sandboxed template
    never sees an object with methods it does not know to be safe. Other objects become their `str()`."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    return str(value)


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list | None = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` (a list of `{"role", "content", ...}` dicts) with `template`.

    `special_tokens` (bos_token, eos_token, ...) become template variables; `kwargs` (documents,
    enable_thinking, ...) override them. `continue_final_message=True` leaves the last message open (its text
    ends the prompt, with no end-of-turn after it); it excludes `add_generation_prompt`."""
    continue_final = bool(kwargs.pop("continue_final_message", False))
    if continue_final and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    chat = [_normalize_message(m) for m in plain_data(list(messages))]
    # A tag appended to the final message's text marks where the prompt must end.
    tag = "\U000f0010CONTINUE\U000f0010"
    if continue_final:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message with string content")
        chat[-1]["content"] += tag
    documents = plain_data(kwargs.pop("documents", None))
    variables = {key: value for key, value in (special_tokens or {}).items() if value is not None}
    variables.update(plain_data(kwargs))
    try:
        text = compile_template(template).render(
            messages=chat, tools=plain_data(tools), documents=documents,
            add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template failed: {exc}") from exc
    if continue_final:
        at = text.rfind(tag)
        if at < 0:
            raise ValueError("continue_final_message: the template dropped the final message")
        text = text[:at]
    return text


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _normalize_message(message: Any) -> dict:
    """As HF does before rendering: drop keys whose value is None (APIs send `content: null`, templates expect
    the key absent), and expose a message's reasoning under both `reasoning_content` and `thinking`."""
    if not isinstance(message, dict):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


# ---------------------------------------------------------------- control-token marking

# Two private-use code points bracket the index of a user-typed control string: START idx END.
MARK_START = "\U000f0001"
MARK_END = "\U000f0002"
_MARK_RE = re.compile(f"{MARK_START}([0-9]+){MARK_END}")
_STRAY_MARKS = re.compile(f"[{MARK_START}{MARK_END}]")


def control_pattern(controls: Iterable[str]) -> re.Pattern[str] | None:
    """A regex matching any of `controls`, longest first at each position (leftmost-longest, like the
    tokenizers library's added-token matcher). None when there are no controls."""
    ordered = sorted({c for c in controls if c}, key=len, reverse=True)
    if not ordered:
        return None
    return re.compile("|".join(re.escape(c) for c in ordered))


def mark_control_text(value: Any, pattern: re.Pattern[str] | None, found: list[str]) -> Any:
    """Copy `value` (messages, tools, ...) replacing every match of `pattern` in its string values (dict keys
    are left alone) with `MARK_START idx MARK_END`, where `found[idx]` is the replaced text.
    Marker code points already in the input are dropped, so a user cannot forge a marker."""
    if isinstance(value, str):
        value = _STRAY_MARKS.sub("", value)
        if pattern is None:
            return value

        def _mark(m: re.Match[str]) -> str:
            found.append(m.group(0))
            return f"{MARK_START}{len(found) - 1}{MARK_END}"

        return pattern.sub(_mark, value)
    if isinstance(value, Mapping):
        return {k: mark_control_text(v, pattern, found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_control_text(v, pattern, found) for v in value]
    return value


def unmark(text: str, found: list[str]) -> str:
    """Put the user's control-looking text back in place of its markers (stray marker halves are dropped)."""
    text = _MARK_RE.sub(lambda m: found[int(m.group(1))] if int(m.group(1)) < len(found) else "", text)
    return _STRAY_MARKS.sub("", text)


def check_chat_template(name_or_path: str | None) -> None:
    """Start-up check of `--chat-template`: it resolves (built-in name, file or Jinja text) and parses as Jinja;
    ValueError naming the problem otherwise. None (the model's own template) passes."""
    if name_or_path is None:
        return
    text = resolve_chat_template(name_or_path, None)
    if text is None:
        raise ValueError(f"--chat-template {name_or_path!r} names a config file without a chat_template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {name_or_path!r} is not a valid Jinja template: {e} (line {e.lineno})"
                         ) from None
