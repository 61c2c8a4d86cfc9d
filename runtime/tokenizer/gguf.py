"""A tokenizer from a GGUF file's `tokenizer.*` metadata, built programmatically.

Byte-level BPE (vocab, merges, the pre-tokenizer named by `tokenizer.ggml.pre`) or SentencePiece-style merges
recovered from scores; CONTROL / USER_DEFINED token types become added tokens. The result is the one
`Tokenizer` class of runtime/tokenizer/tokenizer.py; encode/decode run in the Rust `tokenizers` library.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from kernels import fallbacks
from runtime.tokenizer.tokenizer import Tokenizer, TokenizerInfo, _with_bos_eos

logger = logging.getLogger(__name__)


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
        fallbacks.record("tokenizer_pre", f"unknown tokenizer.ggml.pre {pre!r}: the GPT-2 split")
        spec = _PRE_TOKENIZERS["gpt2"]
    split, digits, nfc = spec
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps), (normalizers.NFC() if nfc else None)



# ---------------------------------------------------------------- GGUF


def _read_gguf_tokenizer_metadata(path: str) -> dict[str, Any]:
    from runtime import gguf_file

    return {key: v for key, v in gguf_file.metadata(path).items()
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


