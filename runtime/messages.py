"""Typed messages at every process boundary (docs/protocol.md).

server (TokenizerManager) --ToScheduler--> scheduler --ToDetokenizer--> detokenizer --ToTokenizer--> server
Every message is a msgspec Struct with a tag; each channel carries a tagged union, msgpack-encoded.
No pickle anywhere. `Codec(union)` encodes/decodes one channel's messages.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

import msgspec

from runtime.sampling.params import SamplingParams


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of every message; the tag is the class name."""


# ---------------------------------------------------------------- finish reasons
class FinishStop(msgspec.Struct, tag_field="type", tag="stop", frozen=True, kw_only=True):
    """Stopped by EOS, a stop token id or a stop string (`matched`), or by its grammar (`matched` None: the
    last token is content). JSON: SGLang's `{"type": "stop", "matched": ...}`."""

    type: ClassVar[str] = "stop"
    matched: str | int | None = None


class FinishLength(msgspec.Struct, tag_field="type", tag="length", frozen=True, kw_only=True, omit_defaults=True):
    """Reached `length` new tokens (or the JSON closing window narrowed its last ones). `matched`: an EOS that
    happened to be the last token (the detokenizer still trims it)."""

    type: ClassVar[str] = "length"
    length: int
    matched: int | None = None


class FinishAbort(msgspec.Struct, tag_field="type", tag="abort", frozen=True, kw_only=True, omit_defaults=True):
    """Aborted by a client, an operator or an error; `status_code` when the cause maps to an HTTP status."""

    type: ClassVar[str] = "abort"
    message: str
    status_code: int | None = None


FinishReason = Union[FinishStop, FinishLength, FinishAbort]  # noqa: UP007


# ---------------------------------------------------------------- server -> scheduler
class TokenizedGenerateReq(Msg):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs; k: prompt positions k.. get logprobs
    top_logprobs_num: int = 0
    stream: bool = False
    input_text: str | None = None
    priority: int = 0  # --enable-priority-scheduling only (else always 0)
    prediction_ids: list[int] | None = None  # predicted output tokens: the n-gram proposer's draft source


class TokenizedEmbeddingReq(Msg):
    """One input of an embedding request (embedding mode): its token ids, already checked against the
    context length and the vocabulary."""

    rid: str
    input_ids: list[int]


class BatchTokenizedEmbeddingReq(Msg):
    """Every input of one embedding request in one message, so they reach one scheduler step together."""

    reqs: list[TokenizedEmbeddingReq]


class AbortReq(Msg):
    rid: str | None = None  # prefix match: "abc" aborts "abc" and "abc_1" ...
    abort_all: bool = False
    message: str = "aborted by client"


class FlushCacheReq(Msg):
    pass


class GetInternalStateReq(Msg):
    pass


class ShutdownReq(Msg):
    pass


# ---------------------------------------------------------------- scheduler -> detokenizer
class ReqTokenOut(Msg):
    """One request's progress this step. `new_ids` are tokens since the last output for this rid."""

    rid: str
    new_ids: list[int]
    finish_reason: FinishReason | None = None  # None while running
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_trim: str | None = None  # matched stop string to cut from the text tail
    spec_verify_ct: int = 0  # speculative verify steps of this request so far
    spec_accepted_tokens: int = 0  # proposed tokens they accepted
    spec_draft_tokens: int = 0  # proposed tokens they verified
    # logprobs, aligned with new_ids: (logprob, token id) and per position a top-k list
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # prompt logprobs, sent once with the first output: first entry's logprob is None
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None


class BatchTokenOut(Msg):
    outs: list[ReqTokenOut]


# ---------------------------------------------------------------- detokenizer -> server
class ReqTextOut(Msg):
    """`text_delta` is new text since the last output for this rid (never a broken UTF-8 sequence).

    `trim` > 0 only on a finishing output: drop that many characters from the end of the text sent so far
    before appending `text_delta` (a stop string partly sent earlier is cut from the final text; the
    TokenizerManager holds back a streamed tail that could start a stop string, so clients never see it).
    """

    rid: str
    text_delta: str
    new_ids: list[int]
    trim: int = 0
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None


class BatchTextOut(Msg):
    outs: list[ReqTextOut]


class EmbeddingOut(msgspec.Struct):
    """One input's embedding: float32 little-endian bytes of `dim` values (the scheduler's pooled, normalized
    output; the server turns them into a JSON float list or base64 without another copy). `error` set: the
    request failed and `embedding` is empty."""

    rid: str
    embedding: bytes
    prompt_tokens: int
    error: str | None = None


class BatchEmbeddingOut(Msg):
    """Scheduler -> TokenizerManager directly (no text to detokenize)."""

    outs: list[EmbeddingOut]


class FlushCacheOut(Msg):
    success: bool
    message: str = ""


class InternalStateOut(Msg):
    state: dict[str, Any]


class ModelInfo(msgspec.Struct, frozen=True):
    """What the scheduler's model tells the parent when ready (request validation needs it)."""

    context_len: int
    vocab_size: int
    max_total_num_tokens: int
    is_embedding: bool = False  # an encoder served by the embedding scheduler (runtime/scheduler/embedding.py)
    embedding_dim: int = 0  # its embedding width (embedding mode)
    matryoshka_dims: tuple[int, ...] = ()  # widths it may be cut to (embedding mode; empty: only its own)
    fallbacks: dict[str, str] = {}  # start-up fallbacks of the scheduler process (kernels/fallbacks.py)


class ReadyMsg(Msg):
    """A child reports it is ready (or failed to start) to its parent, once."""

    name: str
    ok: bool
    model: ModelInfo | None = None  # the scheduler's; None from the detokenizer and on failure
    error: str = ""


ToScheduler = Union[TokenizedGenerateReq, BatchTokenizedEmbeddingReq, AbortReq, FlushCacheReq, GetInternalStateReq, ShutdownReq]  # noqa: UP007
ToDetokenizer = Union[BatchTokenOut, ShutdownReq]  # noqa: UP007
ToTokenizer = Union[BatchTextOut, BatchEmbeddingOut, FlushCacheOut, InternalStateOut]  # noqa: UP007


class Codec:
    """msgpack encoder/decoder for one channel's tagged union."""

    def __init__(self, union: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)

    def encode(self, msg: Msg) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._dec.decode(data)
