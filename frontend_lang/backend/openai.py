"""OpenAI backend: any OpenAI-compatible server (radixgen's /v1, SGLang, vLLM, OpenAI itself).

Chat models: a gen must come right after `assistant` begins; the request carries `s.messages_` (the finished
turns) to `/v1/chat/completions`. Completion models: the request carries `s.text_` to `/v1/completions`,
and `select` probes the choices token by token with `logit_bias` (needs a tokenizer with
`encode(str) -> list[int]` matching the server's model). Non-standard sampling fields (`top_k`, `min_p`,
`regex`, ...) travel in the body, as SGLang-style servers accept them; `json_schema` becomes
`response_format`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

from frontend_lang import ir
from frontend_lang.backend.base import BaseBackend
from frontend_lang.backend.http import BackendError, HttpClient
from frontend_lang.chat_template import ChatTemplate, get_chat_template_by_model_path
from frontend_lang.choices import ChoicesDecision

COMPLETION_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "babbage-002", "davinci-002")


class OpenAI(BaseBackend):
    def __init__(self, model_name: str, is_chat_model: bool | None = None, chat_template: ChatTemplate | None = None,
                 base_url: str | None = None, api_key: str | None = None, tokenizer: Any = None,
                 timeout: float = 600.0, max_retries: int = 3) -> None:
        super().__init__()
        self.model_name = model_name
        self.is_chat_model = model_name not in COMPLETION_MODEL_NAMES if is_chat_model is None else is_chat_model
        self.chat_template = chat_template or get_chat_template_by_model_path(model_name)
        base_url = base_url or os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1")
        self.http = HttpClient(base_url, api_key or os.environ.get("OPENAI_API_KEY"), timeout)
        self.tokenizer = tokenizer
        self.max_retries = max_retries

    # ------------------------------------------------------------------ requests
    def _post(self, path: str, body: dict) -> dict:
        for attempt in range(self.max_retries):
            try:
                return self.http.post_json(path, body)
            except BackendError as e:
                if e.status < 500 or attempt == self.max_retries - 1:
                    raise
            time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def _body(self, s: Any, params: ir.SamplingParams) -> tuple[str, dict]:
        _refuse_unpassable(params)
        std, extra = params.to_openai_kwargs()
        body: dict[str, Any] = {"model": self.model_name, **std, **extra}
        if params.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": json.loads(params.json_schema)}}
        if self.is_chat_model:
            prefix = self.chat_template.get_prefix_and_suffix("assistant", s.messages_)[0]
            if s.cur_role != "assistant" or not s.text_.endswith(prefix):
                raise RuntimeError("with an OpenAI chat model, gen() must come right after assistant begins, "
                                   "e.g. s += assistant(gen('answer'))")
            body["messages"] = list(s.messages_)
            return "/chat/completions", body
        body["prompt"] = s.text_
        return "/completions", body

    @staticmethod
    def _meta(obj: dict, choice: dict) -> dict:
        usage = obj.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {"id": obj.get("id"), "finish_reason": choice.get("finish_reason"),
                "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": details.get("cached_tokens")}

    def generate(self, s: Any, sampling_params: ir.SamplingParams) -> tuple[str, dict]:
        path, body = self._body(s, sampling_params)
        obj = self._post(path, body)
        choice = obj["choices"][0]
        text = choice["message"]["content"] if self.is_chat_model else choice["text"]
        return text or "", self._meta(obj, choice)

    def generate_stream(self, s: Any, sampling_params: ir.SamplingParams) -> Iterator[tuple[str, dict]]:
        path, body = self._body(s, sampling_params)
        body["stream"] = True
        meta: dict = {}
        for event in self.http.post_sse(path, body):
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            delta = (choice.get("delta") or {}).get("content") if self.is_chat_model else choice.get("text")
            if choice.get("finish_reason"):
                meta = self._meta(event, choice)
            if delta:
                yield delta, meta
        yield "", meta

    # ------------------------------------------------------------------ select (completion models)
    def select(self, s: Any, choices: list[str], temperature: float, choices_method: Any) -> ChoicesDecision:
        if self.is_chat_model:
            raise NotImplementedError("select() needs a completion model with the OpenAI backend "
                                      "(is_chat_model=False); chat models cannot score choices")
        if self.tokenizer is None:
            raise ValueError("OpenAI.select needs tokenizer= (an object with encode(str) -> list[int])")
        token_ids = [list(self.tokenizer.encode(c)) for c in choices]
        prompt = list(self.tokenizer.encode(s.text_))
        scores = [0] * len(choices)
        valid = [len(t) > 0 for t in token_ids]
        for step in range(max(len(t) for t in token_ids)):
            # Allow only the tokens the live choices have at this step; the server picks the likeliest.
            bias = {str(t[step]): 100 for t, ok in zip(token_ids, valid, strict=True) if ok}
            obj = self._post("/completions", {"model": self.model_name, "prompt": prompt, "max_tokens": 1,
                                              "temperature": 0, "logit_bias": bias})
            got = self.tokenizer.encode(obj["choices"][0]["text"])
            token = got[0] if got else None
            for i, t in enumerate(token_ids):
                if not valid[i]:
                    continue
                if token == t[step]:
                    scores[i] += 1
                else:
                    valid[i] = False
                if step == len(t) - 1:
                    valid[i] = False
            if sum(valid) <= 1 or token is None:
                break
            prompt.append(token)
        best = max(range(len(choices)), key=lambda i: (scores[i], -len(token_ids[i])))
        return ChoicesDecision(choices[best], {"scores": scores})

    def shutdown(self) -> None:
        self.http.close()


def _refuse_unpassable(params: ir.SamplingParams) -> None:
    """Raise (ValueError naming them) for gen options this backend cannot send, rather than drop them: more than
    one sample, stop_regex, and the native logprob options."""
    bad = []
    if params.n not in (None, 1):
        bad.append(f"n={params.n}")
    if params.stop_regex is not None:
        bad.append("stop_regex")
    bad += [k for k in ir.LOGPROB_KEYS if getattr(params, k) not in (None, False)]
    if bad:
        raise ValueError(f"the OpenAI backend cannot pass {', '.join(bad)} (use RuntimeEndpoint for them)")
