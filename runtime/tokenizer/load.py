"""`load_tokenizer(path)`: a GGUF file (runtime/tokenizer/gguf.py) or a Hugging Face model directory
(tokenizer.json + tokenizer_config.json + special_tokens_map.json + generation_config.json)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import tokenizers

from runtime.tokenizer.chat_template import template_from_config
from runtime.tokenizer.gguf import _from_gguf
from runtime.tokenizer.tokenizer import Tokenizer, TokenizerInfo, _with_bos_eos

logger = logging.getLogger(__name__)


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
    # A tokenizer.json may carry fixed padding and truncation (BERT checkpoints: pad and cut to 128): ids are
    # exactly the text's here; lengths are checked (and cut only when a request asks) by the callers.
    backend.no_padding()
    backend.no_truncation()
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
        bos_text = backend.id_to_token(bos)
        assert bos_text is not None  # bos came from token_to_id
        _with_bos_eos(backend, {bos: bos_text}, bos, None, True, False)
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
            return _from_gguf(path)
        raise ValueError(f"{path}: expected a .gguf file or a model directory")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return _from_hf_dir(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf")) if os.path.isdir(path) else []
    if len(ggufs) == 1:
        return _from_gguf(os.path.join(path, ggufs[0]))
    raise FileNotFoundError(f"{path}: no tokenizer.json and not exactly one .gguf file")
