"""RuntimeEndpoint: a radixgen (or SGLang) server spoken to over its native API.

Wire format (what SGLang's own frontend client sends, so either server works):
- gen: `POST /generate {"text": prompt, "sampling_params": {every key, null when unset}, [logprob keys]}`;
  streaming adds `"stream": true` and reads SSE events carrying the cumulative text.
- select: `POST /generate` of the prefix with `max_new_tokens: 0` (caches it, tells `prompt_tokens`), then one
  batch request `text: [prefix + choice, ...]`, `max_new_tokens: 0`, `return_logprob`,
  `return_text_in_logprobs`, `logprob_start_len = max(prompt_tokens - 2, 0)`; each answer's
  `meta_info.input_token_logprobs` is a list of `[logprob, token_id, text]` triples. A server that refuses
  a batch with 422 (sglang-router takes one `text` per request) gets one request per choice instead, from
  then on (`batch_refused`); the answers are the same, only the round trips differ.
- fork / run_batch pre-cache: a `max_new_tokens: 0` request of the shared prefix, so the branches find it
  in the radix cache.
- `GET /get_model_info` at construction: `model_path` picks the chat template.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend_lang import ir
from frontend_lang.backend.base import BaseBackend
from frontend_lang.backend.http import BackendError, GenerationAborted, HttpClient
from frontend_lang.chat_template import get_chat_template, get_chat_template_by_model_path
from frontend_lang.choices import ChoicesDecision, ChoicesSamplingMethod
from frontend_lang.global_config import global_config


class RuntimeEndpoint(BaseBackend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None,
                 chat_template_name: str | None = None, timeout: float = 600.0) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.http = HttpClient(self.base_url, api_key, timeout, verify)
        self.model_info: dict = self.http.get_json("/get_model_info")
        if chat_template_name is not None:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = get_chat_template_by_model_path(str(self.model_info.get("model_path", "")))
        self.supports_images = self.chat_template.image_token is not None
        self.batch_refused = False  # set once the server answered a batched /generate with 422

    def _generate_many(self, key: str, prompts: list[Any], rest: dict[str, Any]) -> list[dict]:
        """One answer per prompt (`key` is "text" or "input_ids"): one batched /generate, or one request per
        prompt when the server refuses batches (422: sglang-router's body type has a single `text`)."""
        if not self.batch_refused:
            try:
                return self.http.post_json("/generate", {key: prompts, **rest})
            except BackendError as e:
                if e.status != 422:
                    raise
                self.batch_refused = True
        return [self.http.post_json("/generate", {key: p, **rest}) for p in prompts]

    # ------------------------------------------------------------------ prefix caching
    def _prefill(self, text: str) -> dict:
        return self.http.post_json("/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}})

    def cache_prefix(self, prefix_str: str) -> None:
        self._prefill(prefix_str)

    def commit_lazy_operations(self, s: Any) -> None:
        if s.text_:
            self._prefill(s.text_)

    # ------------------------------------------------------------------ generation
    def _generate_body(self, s: Any, params: ir.SamplingParams) -> dict:
        sampling = {"skip_special_tokens": global_config.skip_special_tokens_in_output,
                    "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                    **params.to_native_kwargs()}
        body: dict[str, Any] = {"text": s.text_, "sampling_params": sampling}
        if s.cur_images:  # never dropped: a server that cannot take them refuses image_data with a 400
            body["image_data"] = list(s.cur_images)
        for key in ir.LOGPROB_KEYS:
            value = getattr(params, key)
            if value is not None:
                body[key] = value
        if params.reasoning_parser is not None:  # the gen's constraint applies after the thinking
            body["reasoning_parser"] = params.reasoning_parser
        return body

    def generate(self, s: Any, sampling_params: ir.SamplingParams) -> tuple[str, dict]:
        obj = self.http.post_json("/generate", self._generate_body(s, sampling_params))
        _raise_if_aborted(obj["meta_info"], self.base_url)
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s: Any, sampling_params: ir.SamplingParams) -> Iterator[tuple[str, dict]]:
        body = self._generate_body(s, sampling_params)
        body["stream"] = True
        pos = 0
        for event in self.http.post_sse("/generate", body):
            text = event["text"]
            delta = text[pos:]
            pos = len(text)
            _raise_if_aborted(event.get("meta_info", {}), self.base_url)
            yield delta, event.get("meta_info", {})

    def separate_reasoning(self, text: str, model_type: str) -> tuple[str, str]:
        out = self.http.post_json("/separate_reasoning", {"text": text, "reasoning_parser": model_type})
        return out["reasoning_text"], out["text"]

    # ------------------------------------------------------------------ select
    def select(self, s: Any, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        if temperature > 1e-5:
            raise ValueError("select scores choices greedily: temperature must be 0")
        if s.cur_images:
            raise NotImplementedError("select() after an image() is not supported by RuntimeEndpoint (its scoring "
                                      "requests carry no image_data)")
        prefix_meta = self._prefill(s.text_)["meta_info"]
        logprob_start_len = max(int(prefix_meta["prompt_tokens"]) - 2, 0)  # room for the boundary token
        answers = self._generate_many("text", [s.text_ + c for c in choices], {
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": logprob_start_len,
        })
        input_lp = [choice_triples(a["meta_info"]["input_token_logprobs"], c, s.text_)
                    for a, c in zip(answers, choices, strict=True)]
        output_lp = [a["meta_info"].get("output_token_logprobs", []) for a in answers]
        normalized = [mean_logprob(t) for t in input_lp]
        uncond = None
        if choices_method.requires_unconditional_logprobs:
            uncond_answers = self._generate_many("input_ids", [[t[1] for t in triples] for triples in input_lp], {
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True, "logprob_start_len": 0,
            })
            uncond = [a["meta_info"]["input_token_logprobs"] for a in uncond_answers]
        decision = choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                                  input_token_logprobs=input_lp, output_token_logprobs=output_lp,
                                  unconditional_token_logprobs=uncond)
        decision.meta_info.setdefault("prompt_tokens", prefix_meta.get("prompt_tokens"))
        decision.meta_info.setdefault("cached_tokens", prefix_meta.get("cached_tokens"))
        return decision

    # ------------------------------------------------------------------ embeddings and scores
    def encode(self, prompt: str | list[str]) -> Any:
        """Native `/encode` on an embedding server: `{"embedding", "meta_info"}`, a list of them for a list of
        prompts (SGLang's Runtime.encode returns the same JSON as a string)."""
        return self.http.post_json("/encode", {"text": prompt})

    def score(self, query: str, items: list[str], label_token_ids: list[int], apply_softmax: bool = False) -> Any:
        """`/v1/score` on a generative server: `scores[item][label]`, each label token's probability right
        after query + item."""
        body = {"query": query, "items": items, "label_token_ids": label_token_ids, "apply_softmax": apply_softmax}
        return self.http.post_json("/v1/score", body)["scores"]

    # ------------------------------------------------------------------ server control
    def flush_cache(self) -> None:
        self.http.post_json("/flush_cache", {})

    def get_server_info(self) -> dict:
        return self.http.get_json("/get_server_info")

    def shutdown(self) -> None:
        self.http.close()


def _raise_if_aborted(meta: dict, url: str) -> None:
    """A request the server aborted (e.g. an unsupported grammar) is the program's error, not empty text."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise GenerationAborted(str(reason.get("message", "aborted")), url + "/generate")


def mean_logprob(triples: list[list[Any]]) -> float:
    values = [t[0] for t in triples if t[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


def choice_triples(triples: list[list[Any]], choice: str, prefix: str) -> list[list[Any]]:
    """The triples that score `choice`: the shortest tail of `triples` whose text covers the choice.

    The request asked from two tokens before the prefix's end, so the head covers prefix text; a token
    that straddles the boundary (the tokenizer merged prefix and choice text) is kept, since it is part
    of how the choice is spelled. Without token texts, SGLang's rule: drop the first triple when the
    prefix ends with its text.
    """
    if not triples:
        return triples
    if any(t[2] is None for t in triples[1:]):
        first = triples[0][2]
        return triples[1:] if first is not None and prefix.endswith(first) and len(triples) > 1 else triples
    covered = 0
    start = len(triples)
    while start > 0 and covered < len(choice):
        start -= 1
        covered += len(triples[start][2] or "")
    return triples[start:] if start < len(triples) else triples[-1:]
