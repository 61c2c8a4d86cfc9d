"""The tokenizer: text <-> token ids, special tokens, the EOS set, and chat-template rendering.

Built by `load_tokenizer` (runtime/tokenizer/load.py) from a Hugging Face model directory or a GGUF file's
`tokenizer.*` metadata (runtime/tokenizer/gguf.py). Either way encode/decode run in the Rust `tokenizers` library.

Users: the TokenizerManager (encode, encode_chat, eos_token_ids), the detokenizer (decode, token_bytes) and
the grammar backend (id_to_token, token_bytes, vocab_size).

Control tokens: `self._backend` matches added tokens in text (what chat templates need); `self._plain` is a copy
without any added tokens except whitespace-only ones, so `allow_special=False` tokenizes "<|im_start|>" as the
characters it is (`self._plain_after_control`: the same for text that follows a control token). `encode_chat` renders the template with user strings' control text marked, then encodes the
template's control tokens as ids and everything between them, user text included, as plain text.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import processors

from runtime.tokenizer.chat_template import (
    control_pattern,
    mark_control_text,
    render_chat_template,
    unmark,
)

logger = logging.getLogger(__name__)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes are
    shifted to U+0100.. in byte order, so every byte is a visible character."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR = _byte_to_char()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}

# ---------------------------------------------------------------- the tokenizer


@dataclass(frozen=True)
class TokenizerInfo:
    """What a tokenizer source says beyond the backend itself."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    extra_eos_ids: tuple[int, ...]
    """Further ids that end generation (generation_config.json's eos_token_id; GGUF's eot/eom ids)."""
    chat_template: str | None
    add_bos_token: bool
    """Whether encode(add_special_tokens=True) starts with BOS (already wired into the backend's post-processor)."""
    byte_level: bool
    """GPT-2 byte alphabet vocabulary (else SentencePiece style: '▁' for space, <0xNN> byte tokens)."""
    tokens: tuple[str, ...] | None = None
    """The raw vocabulary by id when the backend cannot give it one-to-one (a GGUF with duplicate strings)."""
    name_or_path: str = ""


class Tokenizer:
    """Encode/decode over a `tokenizers.Tokenizer`, plus special-token facts and chat templates."""

    def __init__(self, backend: tokenizers.Tokenizer, info: TokenizerInfo) -> None:
        self._backend = backend
        self._info = info
        self._plain, self._plain_after_control = _plain_copies(backend)
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self._added_ids = frozenset(added)
        specials = {i for i, t in added.items() if t.special}
        specials |= {i for i in (info.bos_token_id, info.eos_token_id, info.pad_token_id, info.unk_token_id)
                     if i is not None}
        self.special_ids: frozenset[int] = frozenset(specials)
        # Control strings: what `_plain` no longer matches (all added tokens but whitespace-only ones).
        self._controls = {t.content: i for i, t in added.items() if not t.content.isspace()}
        self._lstrip = {t.content for t in added.values() if t.lstrip}
        self._rstrip = {t.content for t in added.values() if t.rstrip}
        self._control_re = control_pattern(self._controls)
        self.bos_token_id: int | None = info.bos_token_id
        self.eos_token_id: int | None = info.eos_token_id
        self.pad_token_id: int | None = info.pad_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            i for i in (info.eos_token_id, *info.extra_eos_ids) if i is not None
        )
        self.chat_template: str | None = info.chat_template
        self.add_bos_token: bool = info.add_bos_token
        self.name_or_path: str = info.name_or_path
        if info.tokens is not None:
            self.vocab_size: int = len(info.tokens)
        else:
            self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._token_bytes: list[bytes] | None = None

    # ------------------------------------------------------------ construction

    # ------------------------------------------------------------ encode

    def encode(self, text: str, add_special_tokens: bool = True, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` adds BOS/EOS only where the model asks for them (SmolLM2
        adds none). `allow_special=False` reads control-token text ("<|im_start|>") as plain characters."""
        backend = self._backend if allow_special else self._plain
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True,
                     allow_special: bool = True) -> list[list[int]]:
        backend = self._backend if allow_special else self._plain
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages`, rendered like HF `apply_chat_template(..., tokenize=False)`.
        `chat_template=` in kwargs overrides the model's template."""
        template = kwargs.pop("chat_template", None) or self.chat_template
        if template is None:
            raise ValueError(f"{self.name_or_path or 'this tokenizer'} has no chat template; pass --chat-template")
        return render_chat_template(template, messages, add_generation_prompt, tools,
                                    special_tokens=self.special_token_strings(), **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Render the chat template and encode it so that control-token ids come only from the template text,
        never from message content, tool definitions or template kwargs. When no user string contains control
        text this equals `encode(apply_chat_template(...), add_special_tokens=False)`. User text is encoded as
        one plain span (`allow_special=False`), so " <|x|>" in content tokenizes exactly as the same text would.
        `chat_template=` overrides the model's template and is trusted (never marked)."""
        template = template_kwargs.pop("chat_template", None)  # trusted: from the operator, not the request
        found: list[str] = []
        marked_messages = mark_control_text(messages, self._control_re, found)
        marked_tools = mark_control_text(tools, self._control_re, found) if tools is not None else None
        marked_kwargs = mark_control_text(template_kwargs, self._control_re, found)
        text = self.apply_chat_template(marked_messages, add_generation_prompt, marked_tools,
                                        chat_template=template, **marked_kwargs)
        return self._encode_template_text(text, found)

    def _encode_template_text(self, text: str, found: list[str]) -> list[int]:
        # Every control match left in `text` was written by the template (user ones are markers now).
        # Pieces between matches: user markers restored, encoded as plain text in one batch.
        controls: list[int] = []
        pieces: list[str] = []
        start = 0
        for m in self._control_re.finditer(text) if self._control_re is not None else ():
            lo, hi = m.span()
            if m.group(0) in self._lstrip:
                lo = len(text[:lo].rstrip())
            if m.group(0) in self._rstrip:
                hi = len(text) - len(text[hi:].lstrip())
            pieces.append(text[start:max(lo, start)])
            controls.append(self._controls[m.group(0)])
            start = hi
        pieces.append(text[start:])
        first = self._plain.encode(unmark(pieces[0], found), add_special_tokens=False).ids
        rest = self._plain_after_control.encode_batch([unmark(p, found) for p in pieces[1:]],
                                                      add_special_tokens=False)
        encoded = [first, *(e.ids for e in rest)]
        ids: list[int] = []
        for k, piece_ids in enumerate(encoded):
            ids.extend(piece_ids)
            if k < len(controls):
                ids.append(controls[k])
        return ids

    # ------------------------------------------------------------ decode and vocabulary

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of `ids`. With `skip_special_tokens=False` and `spaces_between_special_tokens=True`, special
        tokens are set off from their neighbours by one space (the HF slow-tokenizer convention)."""
        ids = list(ids)
        if skip_special_tokens:
            return self._backend.decode([i for i in ids if i not in self.special_ids], skip_special_tokens=False)
        if not spaces_between_special_tokens or not any(i in self.special_ids for i in ids):
            return self._backend.decode(ids, skip_special_tokens=False)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_ids:
                if run:
                    parts.append(self._backend.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self.id_to_token(i))
            else:
                run.append(i)
        if run:
            parts.append(self._backend.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def id_to_token(self, i: int) -> str:
        """The raw vocabulary string of id `i` ("Ġthe", "<|im_end|>")."""
        if self._info.tokens is not None:
            return self._info.tokens[i]
        token = self._backend.id_to_token(i)
        if token is None:
            raise IndexError(f"token id {i} is outside the vocabulary ({self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Raw token string -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for: a byte-level token's bytes (b" " for "Ġ"), an added/special token's
        text in UTF-8, a SentencePiece <0xNN> token's byte."""
        if self._token_bytes is None:
            self._token_bytes = [self._compute_token_bytes(k) for k in range(self.vocab_size)]
        return self._token_bytes[i]

    def _compute_token_bytes(self, i: int) -> bytes:
        token = self.id_to_token(i)
        if i in self._added_ids:
            return token.encode("utf-8")
        if self._info.byte_level:
            # Chars outside the byte alphabet only occur in raw-spelled tokens: take their UTF-8.
            return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in token)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    def special_token_strings(self) -> dict[str, str | None]:
        """bos_token/eos_token/pad_token/unk_token as text, for chat templates."""
        def text(i: int | None) -> str | None:
            return None if i is None else self.id_to_token(i)

        info = self._info
        return {"bos_token": text(info.bos_token_id), "eos_token": text(info.eos_token_id),
                "pad_token": text(info.pad_token_id), "unk_token": text(info.unk_token_id)}

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)})")


def _plain_copies(backend: tokenizers.Tokenizer) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    """`backend` without added tokens (whitespace-only ones kept), so no text becomes a control token; and a
    variant for text that follows a control token. The two differ only for a Metaspace pre-tokenizer with
    prepend_scheme "first", which adds '▁' at the start of the text but not after an added token."""
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["content"].isspace()]
    plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
    if not _no_first_prepend(spec.get("pre_tokenizer")):
        return plain, plain
    return plain, tokenizers.Tokenizer.from_str(json.dumps(spec))


def _no_first_prepend(node: Any) -> bool:
    """Set Metaspace prepend_scheme "first" to "never" in a tokenizer.json subtree; True if any was."""
    changed = False
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
            changed = True
        for value in node.values():
            changed |= _no_first_prepend(value)
    elif isinstance(node, list):
        for value in node:
            changed |= _no_first_prepend(value)
    return changed


def _with_bos_eos(backend: tokenizers.Tokenizer, tokens: Sequence[str] | Mapping[int, str], bos: int | None, eos: int | None,
                  add_bos: bool, add_eos: bool) -> None:
    """Wire BOS/EOS into the post-processor so encode(add_special_tokens=True) and encode_batch add them."""
    head = [tokens[bos]] if add_bos and bos is not None else []
    tail = [tokens[eos]] if add_eos and eos is not None else []
    if not head and not tail:
        return
    special = [(tokens[i], i) for i in {bos if head else None, eos if tail else None} if i is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=[*head, "$A:0", *tail], pair=[*head, "$A:0", *tail, *head, "$B:1", *tail], special_tokens=special
    )


