"""The error every grammar backend raises for a constraint it refuses: a ValueError with an OpenAI error code."""

from __future__ import annotations

from typing import NoReturn


class GrammarValidationError(ValueError):
    """A constraint that is malformed (code "invalid_value") or too expensive (code "grammar_too_complex")."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


def fail(msg: str, code: str = "invalid_value") -> NoReturn:
    raise GrammarValidationError(msg, code)
