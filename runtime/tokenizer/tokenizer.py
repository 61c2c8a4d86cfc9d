"""The tokenizer: text <-> token ids, special tokens, the EOS set, and chat-template rendering.

Sources: a Hugging Face model directory (tokenizer.json + tokenizer_config.json + special_tokens_map.json +
generation_config.json) or a GGUF file's `tokenizer.*` metadata, from which a `tokenizers.Tokenizer` is built
programmatically (byte-level BPE: vocab, merges, the pre-tokenizer named by `tokenizer.ggml.pre`, CONTROL /
USER_DEFINED token types as added tokens). Either way encode/decode run in the Rust `tokenizers` library.

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
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from runtime.tokenizer.chat_template import (
    control_pattern,
    mark_control_text,
    render_chat_template,
    template_from_config,
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

# ---------------------------------------------------------------- GGUF pre-tokenizers (tokenizer.ggml.pre)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# pre name -> (split regex, digits split one by one first, NFC normalizer). "gpt2" is also the fallback.
_PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {}
for _names, _spec in (
    (("gpt2", "default", "mpt", "olmo", "jais"), (_GPT2_SPLIT, False, False)),
    # SmolLM & co: llama.cpp splits every digit off first (\p{N}), as the HF tokenizer.json's Digits step does.
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (_GPT2_SPLIT, True, False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "smaug-bpe", "dbrx", "lfm2",
      "midm-2.0", "jina-v5-nano"),
     (_LLAMA3_SPLIT, False, False)),
    # Qwen2's tokenizer.json NFC-normalizes before splitting.
    (("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2"), (_QWEN2_SPLIT, False, True)),
    (("qwen35",), (_QWEN35_SPLIT, False, True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O_SPLIT, False, False)),
    (("tekken",), (_TEKKEN_SPLIT, False, False)),
):
    for _name in _names:
        _PRE_TOKENIZERS[_name] = _spec

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_level_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    spec = _PRE_TOKENIZERS.get(pre or "gpt2")
    if spec is None:
        logger.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 split", pre)
        spec = _PRE_TOKENIZERS["gpt2"]
    split, digits, nfc = spec
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps), (normalizers.NFC() if nfc else None)


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

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        return _from_gguf(path)

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        return _from_hf_dir(path)

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


# ---------------------------------------------------------------- GGUF


def _read_gguf_tokenizer_metadata(path: str) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {key: fld.contents() for key, fld in reader.fields.items()
            if key.startswith("tokenizer.") or key == "general.architecture"}


def _from_gguf(path: str) -> Tokenizer:
    return tokenizer_from_gguf_metadata(_read_gguf_tokenizer_metadata(path), path)


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any], path: str = "") -> Tokenizer:
    """Build from already-read `tokenizer.*` GGUF metadata (key -> `ReaderField.contents()`).
    `tokenizer.ggml.model`: "gpt2" (byte-level BPE with merges) or "llama" (SentencePiece BPE: scores, no merges)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)

    def meta_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos, eos, pad, unk = (meta_id(n) for n in ("bos_token_id", "eos_token_id", "padding_token_id",
                                                 "unknown_token_id"))
    if kind == "gpt2":
        backend = _byte_level_backend(meta, vocab)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        backend = _sentencepiece_backend(meta, tokens, vocab, unk)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for SPM vocabs
    else:
        raise NotImplementedError(f"{path}: GGUF tokenizer model {kind!r} is not supported ('gpt2', 'llama')")
    extra_eos = tuple(i for i in (meta_id("eot_token_id"), meta_id("eom_token_id")) if i is not None)
    named = {i for i in (bos, eos, pad, unk, *extra_eos) if i is not None}
    # Added tokens keep their vocab ids because their text is already in the BPE vocab.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL or i in named])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED and i not in named])
    _with_bos_eos(backend, tokens, bos, eos, add_bos, bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    info = TokenizerInfo(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, unk_token_id=unk, extra_eos_ids=extra_eos,
        chat_template=meta.get("tokenizer.chat_template"), add_bos_token=add_bos, byte_level=kind == "gpt2",
        tokens=tuple(tokens) if len(vocab) != len(tokens) else None, name_or_path=path,
    )
    return Tokenizer(backend, info)


def _byte_level_backend(meta: Mapping[str, Any], vocab: dict[str, int]) -> tokenizers.Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    pre, norm = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.pre_tokenizer = pre
    if norm is not None:
        backend.normalizer = norm
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int],
                           unk: int | None) -> tokenizers.Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral): '▁' marks a space, <0xNN> tokens catch bytes outside the vocab,
    and merges are ranked by the score of the piece they make (the file has scores, not merges)."""
    scores = list(meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    merges = _merges_from_scores(tokens, scores, vocab)
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
        unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a vocab piece into two vocab pieces is a merge; higher-scoring results merge first,
    ties broken by longer left, then longer right part, then vocab order (as transformers derives them)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((float(score), len(left), len(right), left, right) for left, right in splits)
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable: equal keys keep vocab order
    return [(left, right) for _, _, _, left, right in ranked]


# ---------------------------------------------------------------- Hugging Face directory


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _from_hf_dir(path: str) -> Tokenizer:
    backend = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    config.update({k: v for k, v in _read_json(os.path.join(path, "special_tokens_map.json")).items() if v})
    generation = _read_json(os.path.join(path, "generation_config.json"))

    def config_id(name: str) -> int | None:
        text = _token_text(config.get(name))
        return backend.token_to_id(text) if text is not None else None

    bos, eos = config_id("bos_token"), config_id("eos_token")
    gen_eos = generation.get("eos_token_id")
    gen_eos_ids = tuple(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if eos is None and gen_eos_ids:
        eos = gen_eos_ids[0]
    # BOS: trust tokenizer.json's post-processor; add one there only if tokenizer_config asks and it does not.
    probe = backend.encode("a", add_special_tokens=True).ids
    adds_bos = bos is not None and probe[:1] == [bos]
    if config.get("add_bos_token") and not adds_bos and bos is not None:
        _with_bos_eos(backend, {bos: backend.id_to_token(bos)}, bos, None, True, False)
        adds_bos = True
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            template: str | None = f.read()
    else:
        template = template_from_config(config) or template_from_config(
            _read_json(os.path.join(path, "chat_template.json")))
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    info = TokenizerInfo(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=config_id("pad_token"), unk_token_id=config_id("unk_token"),
        extra_eos_ids=gen_eos_ids, chat_template=template, add_bos_token=adds_bos,
        byte_level="ByteLevel" in json.dumps(decoder), name_or_path=path,
    )
    return Tokenizer(backend, info)


def load_tokenizer(path: str) -> Tokenizer:
    """A `.gguf` file, or a directory holding tokenizer.json (or else exactly one .gguf file)."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return Tokenizer.from_gguf(path)
        raise ValueError(f"{path}: expected a .gguf file or a model directory")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_hf_dir(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf")) if os.path.isdir(path) else []
    if len(ggufs) == 1:
        return Tokenizer.from_gguf(os.path.join(path, ggufs[0]))
    raise FileNotFoundError(f"{path}: no tokenizer.json and not exactly one .gguf file")
