"""How `select` picks among choices from the logprobs the backend measured.

Input (from `RuntimeEndpoint.select`): for each choice, `input_token_logprobs[i]` = the `[logprob, token_id,
text]` triples of the choice's tokens (after the token-healing boundary fix), their mean
`normalized_prompt_logprobs[i]`, and, for methods that set `requires_unconditional_logprobs`, the same
choice tokens scored with no context (`unconditional_token_logprobs[i]`, first entry's logprob None).
Output: a `ChoicesDecision` (the chosen string and the evidence in `meta_info`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Triples = list[list[Any]]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _logprobs(triples: Triples) -> list[float]:
    return [t[0] for t in triples if t[0] is not None]


class ChoicesSamplingMethod:
    requires_unconditional_logprobs = False

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[Triples], output_token_logprobs: list[Triples],
                 unconditional_token_logprobs: list[Triples] | None = None) -> ChoicesDecision:
        raise NotImplementedError


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs, "output_token_logprobs": output_token_logprobs})


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices whose logprob at position j is the maximum among those still in.

    A shorter choice is padded with its own mean logprob. Ties after the last position go to the first.
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [_logprobs(t) for t in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == top]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs, "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix})


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Mean over the choice's tokens of logprob(token | context) - logprob(token | no context).

    Positions where either logprob is unknown (the unconditional first token) are skipped.
    """

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            diffs = [c[0] - u[0] for c, u in zip(cond, uncond, strict=False) if c[0] is not None and u[0] is not None]
            scores.append(_mean(diffs) if diffs else _mean(_logprobs(cond)))
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs, "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
