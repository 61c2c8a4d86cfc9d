"""Embedding requests of the TokenizerManager (embedding mode): inputs -> token ids -> scheduler -> vectors.

Data flow: a route (or `Engine.encode`) hands `EmbeddingRequests.embed` a list of inputs (strings or token-id
lists, shaped by `parse_inputs`); each is tokenized (strings as the model's tokenizer does, [CLS] ... [SEP]
for BERT; token ids as given) and checked (non-empty, in the vocabulary, within the context unless
`truncate`) before anything is sent; then one `TokenizedEmbeddingReq` per input (rid f"{rid}_{i}") goes to
the scheduler, all of a request's in one `BatchTokenizedEmbeddingReq` (so they reach the same step), and the `BatchEmbeddingOut` the scheduler sends back resolves each input's future. A caller
that goes away (client disconnect) aborts its inputs that are still waiting.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.ipc import Sender
from runtime.messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenizedEmbeddingReq,
    ModelInfo,
    TokenizedEmbeddingReq,
)
from runtime.tokenizer.generate_input import RequestError, is_int

Input = str | list[int]


@dataclass(frozen=True)
class Embedded:
    """One input's answer: float32 little-endian bytes of the vector and the input's token count."""

    embedding: bytes
    prompt_tokens: int


def parse_inputs(v: Any, param: str) -> list[Input]:
    """A string, a list of strings, a list of token ids or a list of token-id lists -> one entry per input.
    Wrong types, an empty list and a list mixing kinds are RequestErrors naming `param`."""
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise RequestError(f"'{param}' must be a string, an array of strings, an array of token ids or an array of "
                           "token-id arrays", param, "invalid_type")
    if not v:
        raise RequestError(f"'{param}' must not be an empty array", param, "empty_array")
    if all(is_int(t) for t in v):
        return [list(v)]
    if all(isinstance(x, str) for x in v):
        return list(v)
    if all(isinstance(x, list) and all(is_int(t) for t in x) for x in v):
        return [list(x) for x in v]
    raise RequestError(f"'{param}' must not mix kinds: all strings, all token ids, or all token-id arrays", param,
                       "invalid_type")


def _special_tail(tokenizer: Any) -> int:
    """How many special tokens the tokenizer appends after a text's own ids ([SEP] for BERT)."""
    full, plain = tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False)
    head = next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), 0)
    return max(len(full) - head - len(plain), 0)


class EmbeddingRequests:
    """The embedding side of one TokenizerManager (same sockets, same loop thread)."""

    def __init__(self, send: Sender, info: ModelInfo, tokenizer: Any, max_outstanding: int, stats: Any) -> None:
        self._send, self.info, self.tokenizer, self.stats = send, info, tokenizer, stats
        self.max_outstanding = max_outstanding
        self._pending: dict[str, tuple[asyncio.Future, float]] = {}
        self._tail = _special_tail(tokenizer) if info.is_embedding else 0
        self.failed: str | None = None

    def _ids(self, inputs: list[Input], truncate: bool, param: str) -> list[list[int]]:
        limit, vocab = self.info.context_len, self.info.vocab_size
        texts = [x for x in inputs if isinstance(x, str)]
        for i, x in enumerate(inputs):
            where = param if len(inputs) == 1 else f"{param}[{i}]"
            if isinstance(x, str) and not x:
                raise RequestError(f"'{where}' is an empty string", where, "invalid_value")
            if isinstance(x, str) and len(x) > 32 * limit and not truncate:
                raise RequestError(f"'{where}' is far longer than the model's limit of {limit} tokens", where,
                                   "context_length_exceeded")
            if isinstance(x, list) and not x:
                raise RequestError(f"'{where}' is an empty token array", where, "empty_array")
            if isinstance(x, list) and any(not 0 <= t < vocab for t in x):
                raise RequestError(f"'{where}': token ids must be in [0, {vocab})", where, "invalid_value")
        encoded = iter(self.tokenizer.encode_batch(texts)) if texts else iter(())
        out = []
        for i, x in enumerate(inputs):
            ids = next(encoded) if isinstance(x, str) else x
            if len(ids) > limit:
                where = param if len(inputs) == 1 else f"{param}[{i}]"
                if not truncate:
                    raise RequestError(f"'{where}' has {len(ids)} tokens, more than this model's limit of {limit} "
                                       "tokens (pass truncate: true to cut it to the limit)", where,
                                       "context_length_exceeded")
                tail = self._tail if isinstance(x, str) else 0
                ids = ids[: limit - tail] + (ids[-tail:] if tail else [])
            out.append(ids)
        return out

    async def embed(self, inputs: list[Input], *, truncate: bool = False, param: str = "input",
                    rid: str | None = None) -> list[Embedded]:
        """Every input's embedding, in order. RequestError (nothing sent) on a bad input, on a generative
        server, or when the server is overloaded."""
        if not self.info.is_embedding:
            raise RequestError("this server serves a generative model: embeddings need an encoder checkpoint "
                               "served with --is-embedding", None, "model_not_embedding")
        if self.failed:
            raise RequestError(self.failed, None, "server_unavailable", 503, "server_error")
        all_ids = self._ids(inputs, truncate, param)
        if len(self._pending) + len(all_ids) > self.max_outstanding:
            raise RequestError("the server is overloaded: waiting queue full, retry later", None,
                               "server_overloaded", 503, "server_error", {"Retry-After": "1"})
        base = rid or uuid.uuid4().hex
        loop, now = asyncio.get_running_loop(), time.monotonic()
        rids, futs = [f"{base}_{i}" for i in range(len(all_ids))], []
        if any(r in self._pending for r in rids):
            raise RequestError(f"rid {base!r} is already in use", "rid")
        for r in rids:
            fut = loop.create_future()
            self._pending[r] = (fut, now)
            futs.append(fut)
        self._send.send(BatchTokenizedEmbeddingReq(reqs=[TokenizedEmbeddingReq(rid=r, input_ids=ids)
                                                         for r, ids in zip(rids, all_ids, strict=True)]))
        try:
            return list(await asyncio.gather(*futs))
        finally:
            left = [r for r in rids if r in self._pending]
            for r in left:
                self._pending.pop(r)[0].cancel()
                self._send.send(AbortReq(rid=r, message="client disconnected"))

    def on_batch(self, msg: BatchEmbeddingOut) -> None:
        now = time.monotonic()
        for out in msg.outs:
            entry = self._pending.pop(out.rid, None)
            if entry is None or entry[0].done():
                continue
            fut, created = entry
            if out.error is not None:
                fut.set_exception(RequestError(out.error, None, "internal_error", 500, "server_error"))
                continue
            fut.set_result(Embedded(out.embedding, out.prompt_tokens))
            if self.stats is not None:
                self.stats.on_finish(now - created, out.prompt_tokens, 0, 0, "stop")

    def fail_all(self, message: str) -> None:
        self.failed = message
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(RequestError(message, None, "server_unavailable", 503, "server_error"))
        self._pending.clear()
