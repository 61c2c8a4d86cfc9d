"""Frontend chat templates: the text a role opens and closes with, picked by model path.

The interpreter asks `get_prefix_and_suffix(role, messages_so_far)` when a program enters and leaves a
role; the prefix/suffix text is appended to the program's text, so the prompt the server sees is the
model's chat format. `stop_str` is appended to every gen's stop list; `default_system_prompt` is inserted
when a program's first role is not `system`. Independent of the server's Jinja templates (no imports of
`runtime`): these are hand-written per family, as SGLang's frontend does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class ChatTemplateStyle(Enum):
    PLAIN = "plain"
    LLAMA2 = "llama2"  # the system prompt is folded into the first user turn


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    image_token: str | None = None  # None: the model takes no images
    style: ChatTemplateStyle = ChatTemplateStyle.PLAIN
    # Text placed before the very first message (e.g. a BOS the tokenizer does not add).
    first_prefix: str = field(default="")

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if self.style is ChatTemplateStyle.LLAMA2:
            if role == "system" and not hist_messages:
                # `[INST] <<SYS>>\n{system}\n<</SYS>>\n\n` then the user text continues the same [INST].
                return "[INST] <<SYS>>\n", "\n<</SYS>>\n\n"
            if role == "user" and len(hist_messages) == 1 and hist_messages[0]["role"] == "system":
                return "", suffix
        if not hist_messages and self.first_prefix:
            prefix = self.first_prefix + prefix
        return prefix, suffix


_TEMPLATES: dict[str, ChatTemplate] = {}
_MATCHERS: list[Callable[[str], str | None]] = []


def register_chat_template(template: ChatTemplate) -> None:
    _TEMPLATES[template.name] = template


def register_chat_template_matching_function(func: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """`func(model_path) -> template name or None`; later registrations are tried first."""
    _MATCHERS.insert(0, func)
    return func


def get_chat_template(name: str) -> ChatTemplate:
    if name not in _TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(_TEMPLATES)}")
    return _TEMPLATES[name]


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    for match in _MATCHERS:
        name = match(model_path)
        if name is not None:
            return get_chat_template(name)
    return get_chat_template("default")


def _chatml(name: str, system: str | None, image_token: str | None = None) -> ChatTemplate:
    return ChatTemplate(
        name=name,
        role_prefix_and_suffix={r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")},
        default_system_prompt=system, stop_str=("<|im_end|>",), image_token=image_token)


register_chat_template(ChatTemplate(
    name="default",
    role_prefix_and_suffix={"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
))
register_chat_template(ChatTemplate(
    name="claude",
    role_prefix_and_suffix={"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")},
))
register_chat_template(_chatml("chatml", None))
register_chat_template(_chatml("smollm", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"))
register_chat_template(_chatml("qwen", "You are a helpful assistant."))
register_chat_template(_chatml("chatml-llava", "You are a helpful assistant.", image_token="<image>\n"))
register_chat_template(ChatTemplate(
    name="llama-3-instruct",
    role_prefix_and_suffix={r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
                            for r in ("system", "user", "assistant")},
    stop_str=("<|eot_id|>",),
))
register_chat_template(ChatTemplate(
    name="llama-2-chat",
    role_prefix_and_suffix={"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"),
                            "assistant": (" ", " </s><s>")},
    style=ChatTemplateStyle.LLAMA2,
))
register_chat_template(ChatTemplate(
    name="mistral",
    role_prefix_and_suffix={"system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"), "user": ("[INST] ", " [/INST]"),
                            "assistant": ("", " </s>")},
    stop_str=("</s>",),
))
register_chat_template(ChatTemplate(
    name="vicuna_v1.1",
    role_prefix_and_suffix={"system": ("", " "), "user": ("USER:", " "), "assistant": ("ASSISTANT:", "</s>")},
    default_system_prompt=("A chat between a curious user and an artificial intelligence assistant. "
                           "The assistant gives helpful, detailed, and polite answers to the user's questions."),
    stop_str=("</s>",),
))
register_chat_template(ChatTemplate(
    name="gemma-it",
    role_prefix_and_suffix={"system": ("", ""), "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
                            "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")},
    stop_str=("<end_of_turn>",),
))


@register_chat_template_matching_function
def _match_by_name(model_path: str) -> str | None:
    """Substring rules on the lower-cased path, most specific first."""
    path = model_path.lower()
    rules = [
        (("smollm",), "smollm"),
        (("llava",), "chatml-llava"),
        (("qwen",), "qwen"),
        (("llama-3", "llama3", "llama_3"), "llama-3-instruct"),
        (("llama-2", "llama2"), "llama-2-chat"),
        (("mistral", "mixtral"), "mistral"),
        (("vicuna",), "vicuna_v1.1"),
        (("gemma",), "gemma-it"),
        (("claude",), "claude"),
        (("chatml", "hermes", "tinyllama-chat", "openchat"), "chatml"),
    ]
    for needles, name in rules:
        if any(n in path for n in needles):
            return name
    return None
