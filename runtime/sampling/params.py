"""SamplingParams: what a request asks of the sampler and the finish checks, with SGLang's validation rules.

Built in the server process from the request JSON (`from_dict`, where `null` means "default"), validated
there (`verify`, raising `ValueError` naming the parameter), then carried to the scheduler inside
`TokenizedGenerateReq` as a msgspec Struct.
"""

from __future__ import annotations

import math

import msgspec

GREEDY_EPS = 1e-6


class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    stop_regex: list[str] = []
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k cut
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # SGLang's {"structures": [...], "triggers": [...]} as JSON text
    choices: list[str] | None = None
    logit_bias: dict[str, float] | None = None  # {token id as str: bias}
    sampling_seed: int | None = None
    disable_speculation: bool = False  # opt this request out of speculative decoding (--speculative-algorithm)
    # Thinking (a reasoning model): the constraint applies only after `think_end` is generated. `think_start`
    # set: the model may open its thinking with it (or answer at once, constrained from the first token);
    # unset: the output starts inside the thinking. `thinking_budget`: tokens of thinking before `think_end` is
    # forced (runtime/constrained/thinking.py).
    think_start: str | None = None
    think_end: str | None = None
    thinking_budget: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """From request JSON: unknown keys raise, `null` values mean the default; scalars normalised."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError("sampling_params must be an object")
        fields = set(cls.__struct_fields__)
        kw = {}
        for key, value in d.items():
            if key not in fields:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if value is None:
                continue
            kw[key] = value
        for key in ("stop", "stop_regex"):
            if isinstance(kw.get(key), str):
                kw[key] = [kw[key]]
        if isinstance(kw.get("stop_token_ids"), int):
            kw["stop_token_ids"] = [kw["stop_token_ids"]]
        for key in ("json_schema", "structural_tag"):
            if isinstance(kw.get(key), dict):
                import json

                kw[key] = json.dumps(kw[key])
        try:
            return msgspec.convert(kw, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid sampling_params: {e}") from None

    @property
    def constraints(self) -> tuple[str | list[str] | None, ...]:
        """The grammar constraint fields (at most one is set)."""
        return (self.regex, self.json_schema, self.ebnf, self.structural_tag, self.choices)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter (SGLang's rules)."""
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens} > {self.max_new_tokens}"
            )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if sum(x is not None for x in self.constraints) > 1:
            raise ValueError("only one of regex, json_schema, ebnf, structural_tag and choices may be set")
        if self.think_end == "" or self.think_start == "" or (self.think_start and self.think_end is None):
            raise ValueError("think_end must be a non-empty marker (think_start needs it)")
        if self.thinking_budget is not None and (self.thinking_budget < 0 or self.think_end is None):
            raise ValueError("thinking_budget must be at least 0 and needs think_end")
        if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be valid token ids")
        for key, bias in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise ValueError(f"logit_bias token id {tid} is out of the vocabulary")
            if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
