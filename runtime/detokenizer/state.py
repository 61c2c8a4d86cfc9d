"""Incremental detokenization: token ids per rid in, text deltas per rid out.

Data flow: the scheduler sends `BatchTokenOut` (new ids per rid each step) -> `Detokenizer.process` -> a
`BatchTextOut` of text deltas to the TokenizerManager, which accumulates them.

Per rid we keep the ids produced so far and two offsets into them: `surr` (start of a short window of
already-emitted tokens that gives the tokenizer its left context, e.g. SentencePiece's leading-space rule) and
`read` (first token whose text has not been emitted). Each step decodes `ids[surr:read]` and `ids[surr:]`;
the new text is the difference. Text ending in U+FFFD is an incomplete UTF-8 sequence (a byte-level token
boundary inside a character) and is held back until the next token completes it. So no delta ever holds a
broken character, and, byte-level BPE decoding being concatenative, the deltas add up to
`decode(all ids)`. At finish the full decode is compared with what was sent and any difference repaired
(`ReqTextOut.trim`), then the matched stop string (scheduler's `stop_trim`) or stop token is cut off unless
`no_stop_trim`. States live in an LRU dict bounded by RADIXGEN_DETOKENIZER_MAX_STATES.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.messages import BatchTextOut, BatchTokenOut, FinishLength, FinishStop, ReqTextOut, ReqTokenOut

DecodeFn = Callable[[list[int], bool, bool], str]  # (ids, skip_special_tokens, spaces_between_special_tokens)
REPLACEMENT = "\ufffd"


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    surr: int = 0  # window start: tokens [surr, read) are emitted context
    read: int = 0  # tokens [read, len(ids)) are not emitted yet
    text: str = ""  # everything sent for this rid so far


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _stop_cut(text: str, stop: str, sent_before: int) -> int:
    """Where the matched stop string starts in `text`: the first occurrence ending after the text sent
    before this step (earlier ones did not stop the request, e.g. under min_new_tokens); -1 if absent."""
    pos = text.find(stop, max(0, sent_before - len(stop) + 1))
    return pos if pos >= 0 else text.rfind(stop)


class Detokenizer:
    def __init__(self, decode: DecodeFn, max_states: int = 65536) -> None:
        self._decode = decode
        self._max_states = max_states
        self._states: OrderedDict[str, DecodeState] = OrderedDict()

    @property
    def num_states(self) -> int:
        return len(self._states)

    def process_batch(self, batch: BatchTokenOut) -> BatchTextOut:
        return BatchTextOut(outs=[self.process(o) for o in batch.outs])

    def process(self, out: ReqTokenOut) -> ReqTextOut:
        st = self._states.pop(out.rid, None) or DecodeState()
        new_ids = out.new_ids
        fr = out.finish_reason
        if (isinstance(fr, FinishStop | FinishLength) and not out.no_stop_trim and new_ids
                and isinstance(fr.matched, int) and new_ids[-1] == fr.matched):
            new_ids = new_ids[:-1]  # a matched stop token is not part of the text
        st.ids.extend(new_ids)
        flags = (out.skip_special_tokens, out.spaces_between_special_tokens)
        if fr is None:
            delta = self._step(st, flags)
            self._states[out.rid] = st
            while len(self._states) > self._max_states:
                self._states.popitem(last=False)
            trim = 0
        else:
            delta, trim = self._finish(st, flags, out)
        return ReqTextOut(
            rid=out.rid, text_delta=delta, trim=trim, new_ids=out.new_ids, finish_reason=fr,
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens, num_retractions=out.num_retractions,
            spec_verify_ct=out.spec_verify_ct, spec_accepted_tokens=out.spec_accepted_tokens,
            spec_draft_tokens=out.spec_draft_tokens,
            output_logprobs=out.output_logprobs, output_top_logprobs=out.output_top_logprobs,
            input_logprobs=out.input_logprobs, input_top_logprobs=out.input_top_logprobs,
        )

    def _step(self, st: DecodeState, flags: tuple[bool, bool]) -> str:
        if st.read == len(st.ids):
            return ""
        prefix = self._decode(st.ids[st.surr:st.read], *flags)
        new = self._decode(st.ids[st.surr:], *flags)
        if len(new) <= len(prefix) or new.endswith(REPLACEMENT):
            return ""  # nothing printable yet, or an incomplete character at the end: hold
        delta = new[len(prefix):]
        st.surr, st.read = st.read, len(st.ids)
        st.text += delta
        return delta

    def _finish(self, st: DecodeState, flags: tuple[bool, bool], out: ReqTokenOut) -> tuple[str, int]:
        final = self._decode(st.ids, *flags)
        if out.stop_trim and not out.no_stop_trim:
            pos = _stop_cut(final, out.stop_trim, len(st.text))
            if pos >= 0:
                final = final[:pos]
        keep = _common_prefix_len(st.text, final)
        return final[keep:], len(st.text) - keep

    def drop(self, rid: str) -> None:
        self._states.pop(rid, None)
