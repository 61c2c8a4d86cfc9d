"""Native logprob triples -> OpenAI's two logprob shapes.

Input (TokenizerManager results, `meta_info`): `output_token_logprobs` / `input_token_logprobs` are lists of
`[logprob, token_id, text|None]`; `*_top_logprobs` lists (one per position, or None) of such triples.
Chat: `{"content": [{"token", "bytes", "logprob", "top_logprobs": [{"token", "bytes", "logprob"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
Token text is the single-token decode (tm.token_text); bytes come from the tokenizer's byte table.
"""

from __future__ import annotations

from typing import Any

from runtime.tokenizer.manager import TokenizerManager


class LogprobFormatter:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm
        self._bytes = getattr(tm.tokenizer, "token_bytes", None)

    def _entry(self, lp: float | None, tid: int) -> dict[str, Any]:
        text = self.tm.token_text(tid)
        raw = self._bytes(tid) if self._bytes is not None else text.encode("utf-8")
        return {"token": text, "bytes": list(raw), "logprob": lp}

    def chat(self, pairs: list, tops: list | None, k: int) -> list[dict[str, Any]]:
        """Chat `logprobs.content` entries for `pairs` (with up to k alternatives each)."""
        out = []
        for i, (lp, tid, *_) in enumerate(pairs):
            e = self._entry(lp, tid)
            top = tops[i] if tops is not None and i < len(tops) and tops[i] is not None else []
            e["top_logprobs"] = [self._entry(t[0], t[1]) for t in top[:k]] if k > 0 else []
            out.append(e)
        return out

    def completion(self, pairs: list, tops: list | None, k: int, offset: int) -> dict[str, Any]:
        """A completions `logprobs` object; text offsets start at `offset` (the echoed prompt's length)."""
        tokens, lps, offsets = [], [], []
        top_out: list[dict[str, float] | None] = []
        for i, (lp, tid, *_) in enumerate(pairs):
            text = self.tm.token_text(tid)
            tokens.append(text)
            lps.append(lp)
            offsets.append(offset)
            offset += len(text)
            top = tops[i] if tops is not None and i < len(tops) else None
            if k > 0 and top is not None:
                top_out.append({self.tm.token_text(t[1]): t[0] for t in top[:k]})
            else:
                top_out.append(None)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}


def merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Concatenate two completions logprob objects (echoed prompt, then output)."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
