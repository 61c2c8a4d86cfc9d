"""The speculative draft model (`--speculative-algorithm draft`): a second ModelRunner in the scheduler process.

It has its own KV pool with as many slots as the model's (a request's draft K/V never exceeds its target K/V
by more than k - 1 positions, and the draft keeps no prefix cache), its own slot allocator and
request-to-token table (as many rows as --max-running-requests), and the model's --dtype, --quantization and
context length. It runs unsharded (tensor parallelism is refused with a draft model). When the draft path is
the model's own file, the two share their weights (`ModelRunner.sibling`). Start-up refuses, in one line, a
draft whose tokenizer or vocabulary differs from the model's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from runtime.config import Config, ParallelConfig
from runtime.executor.model_runner import ModelRunner
from runtime.models.registry import resolve_model_path

log = logging.getLogger(__name__)


def same_vocabulary(a: Any, b: Any) -> str | None:
    """None when tokenizers `a` and `b` map every id to the same bytes, else what differs (first id)."""
    if a.vocab_size != b.vocab_size:
        return f"{b.vocab_size} tokens instead of {a.vocab_size}"
    for i in range(a.vocab_size):
        if a.token_bytes(i) != b.token_bytes(i):
            return f"token {i} is {b.token_bytes(i)!r} instead of {a.token_bytes(i)!r}"
    return None


def create_draft_runner(cfg: Config, target: ModelRunner, target_tok: Any) -> ModelRunner:
    """The draft runner for `cfg` (resolved, speculative_algorithm draft); raises ValueError naming what is
    incompatible with `target` (tokenizer, vocabulary size)."""
    from runtime.tokenizer.load import load_tokenizer

    path = cfg.speculative.speculative_draft_model_path
    assert path is not None, "checked by runtime.config.resolve"
    if os.path.realpath(resolve_model_path(path)) == os.path.realpath(target.model_path):
        log.info("draft model: the model itself (shared weights, own KV pool)")
        return target.sibling()
    try:
        tok = load_tokenizer(path)
    except Exception as e:
        raise ValueError(f"--speculative-draft-model-path {path}: cannot load its tokenizer ({e})") from e
    why = same_vocabulary(target_tok, tok)
    if why is not None:
        raise ValueError(f"--speculative-draft-model-path {path}: its tokenizer differs from the model's ({why})")
    model = dataclasses.replace(cfg.model, model_path=path, tokenizer_path=None, served_model_name=None)
    cache = dataclasses.replace(cfg.cache, max_total_tokens=target.pool.num_slots)
    draft = ModelRunner(dataclasses.replace(cfg, model=model, cache=cache, parallel=ParallelConfig()), progress=False)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"--speculative-draft-model-path {path}: vocabulary of {draft.vocab_size} logits instead "
                         f"of the model's {target.vocab_size}")
    return draft
