"""The offline `Engine`: the server's runtime without HTTP (docs/architecture.md).

It launches the runtime exactly as the server does (`runtime.launch.Launch`) and runs the
TokenizerManager on an asyncio loop in a background thread; `generate` hands requests to that loop and
waits. Results are the native /generate dicts: `text`, `output_ids`, `meta_info` (`id`, `finish_reason`,
`prompt_tokens`, `completion_tokens`, `cached_tokens`, logprob fields when asked).

    with Engine(max_total_tokens=4096) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        for chunk in engine.generate("Once", {"max_new_tokens": 16}, stream=True):
            print(chunk["text"])  # cumulative text, like the SSE chunks

    with Engine(embedding_model_path()) as engine:  # an encoder: embedding mode (auto-detected)
        vec = engine.encode("The capital of France is Paris.")["embedding"]
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import msgspec
import numpy as np

from runtime.config import make_config
from runtime.launch import Launch
from runtime.messages import ModelInfo
from runtime.tokenizer.embedding import parse_inputs
from runtime.tokenizer.generate_input import GenerateRequest, RequestError, normalize_generate
from runtime.tokenizer.manager import TokenizerManager

T = TypeVar("T")
_END = object()


def _plain(result: dict[str, Any]) -> dict[str, Any]:
    """A result in the native /generate JSON shape: the typed finish reason as its JSON object."""
    fr = result["meta_info"].get("finish_reason")
    if fr is None:
        return result
    return {**result, "meta_info": {**result["meta_info"], "finish_reason": msgspec.to_builtins(fr)}}


class Engine:
    def __init__(self, model_path: str | None = None, **config: Any) -> None:
        self._dead: str | None = None
        self._closed = False
        self._launch = Launch(make_config(model_path=model_path, **config))
        self.cfg = self._launch.cfg
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixgen-engine", daemon=True)
        self._thread.start()
        self._launch.start()
        try:
            self.tokenizer, model = self._launch.wait_ready()
            self.server_config = dict(self._launch.config)
            self._tm: TokenizerManager = self._call(self._start_tm(model))
        except BaseException:
            self.shutdown()
            raise
        self._launch.watch(self._on_death)

    async def _start_tm(self, model: ModelInfo) -> TokenizerManager:
        return self._launch.tokenizer_manager(self.tokenizer, model, None)

    def _on_death(self, reason: str) -> None:
        self._dead = reason
        self._loop.call_soon_threadsafe(self._tm.fail_all, reason)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            raise
        except RequestError as e:
            if e.status >= 500:
                raise RuntimeError(e.message) from None
            raise

    # ------------------------------------------------------------ public API

    @property
    def context_len(self) -> int:
        return self._tm.context_len

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None, *,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] | None = None, top_logprobs_num: int | list[int] | None = None,
                 return_text_in_logprobs: bool = False, stream: bool = False,
                 rid: str | list[str] | None = None, priority: int | None = None,
                 prediction: str | None = None) -> Any:
        """One prompt -> a dict (a list of n dicts when n > 1); a list of prompts -> a flat list in order
        (prompt-major, then sample). `stream=True` (one prompt) returns an iterator of cumulative chunks.
        `priority`: with enable_priority_scheduling; `prediction`: the expected output text, the n-gram
        proposer's draft source (speculative_algorithm="ngram"), as OpenAI's predicted outputs."""
        self._check_alive()
        body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params, "rid": rid,
                "stream": stream, "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs,
                "priority": priority}
        reqs, is_batch = normalize_generate(body)
        for r in reqs:
            r.prediction = prediction
        if stream:
            return self._stream(reqs[0])
        results = self._call(self._collect(reqs))
        return results if is_batch or len(results) > 1 else results[0]

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                             **kw: Any) -> Any:
        """`generate` (not streaming) for callers on their own asyncio loop."""
        self._check_alive()
        reqs, is_batch = normalize_generate({"text": prompt, "sampling_params": sampling_params, **kw})
        fut = asyncio.run_coroutine_threadsafe(self._collect(reqs), self._loop)
        results = await asyncio.wrap_future(fut)
        return results if is_batch or len(results) > 1 else results[0]

    async def _collect(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        handles = self._tm.submit_many(reqs)
        try:
            per = await asyncio.gather(*(h.finals() for h in handles))
        finally:
            for h in handles:
                h.abort()
        return [_plain(r) for rs in per for r in rs]

    def _stream(self, req: GenerateRequest) -> Iterator[dict[str, Any]]:
        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                handle = self._tm.submit(req)
                async for item in handle:
                    q.put(_plain(handle.public(item)))
            except BaseException as e:  # handed to the consumer thread
                q.put(e)
            finally:
                q.put(_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, BaseException):
                    if isinstance(item, RequestError) and item.status >= 500:
                        raise RuntimeError(item.message)
                    if isinstance(item, asyncio.CancelledError):
                        return
                    raise item
                yield item
        finally:
            fut.cancel()  # a consumer that stops early aborts the request

    def encode(self, prompt: str | list[str] | None = None, *, input_ids: list[int] | list[list[int]] | None = None,
               truncate: bool = False, rid: str | None = None) -> Any:
        """Embedding mode (SGLang's Engine.encode): one prompt -> `{"embedding": [float], "meta_info": {"id",
        "prompt_tokens"}}`, a list of prompts (or of token-id lists) -> a list of them, in order."""
        self._check_alive()
        if (prompt is None) == (input_ids is None):
            raise RequestError("give exactly one of prompt and input_ids", "text")
        value = prompt if prompt is not None else input_ids
        inputs = parse_inputs(value, "text" if prompt is not None else "input_ids")
        base = rid or uuid.uuid4().hex
        results = self._call(self._tm.embeddings.embed(inputs, truncate=truncate, rid=base))
        out = [{"embedding": np.frombuffer(e.embedding, dtype="<f4").tolist(),
                "meta_info": {"id": f"{base}_{i}", "prompt_tokens": e.prompt_tokens}} for i, e in enumerate(results)]
        single = isinstance(value, str) or (input_ids is not None and all(isinstance(t, int) for t in input_ids))
        return out[0] if single else out

    def flush_cache(self) -> bool:
        return self._call(self._tm.flush_cache()).success

    def get_server_info(self) -> dict[str, Any]:
        """The resolved config plus `internal_states` (as /get_server_info)."""
        state = self._call(self._tm.get_internal_state())
        return {**self.server_config, "internal_states": [state]}

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._loop.call_soon_threadsafe(self._tm.abort, rid, abort_all)

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self._dead:
            raise RuntimeError(self._dead)

    def shutdown(self) -> None:
        """Stop the child processes and the loop thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        tm = getattr(self, "_tm", None)
        if tm is not None and self._loop.is_running():
            with contextlib.suppress(Exception):  # closing anyway
                asyncio.run_coroutine_threadsafe(tm.close(), self._loop).result(5)
        self._launch.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
