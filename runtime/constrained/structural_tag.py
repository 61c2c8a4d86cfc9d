"""SGLang's `structural_tag` constraint, parsed once for every backend, and as an llguidance Lark grammar.

Spec (JSON text): `{"structures": [{"begin": str, "schema": JSON schema, "end": str}, ...], "triggers": [str]}`.
Meaning (xgrammar's, which SGLang serves): the output is free text in which a trigger may only appear as the
start of a tag; a tag is one structure's `begin`, a JSON document valid against its schema, then its `end`,
after which free text resumes. Every `begin` must start with one of the triggers.

Lark shape (llguidance): per trigger k, a lazy lexeme `TEXT trigger_k` (free text up to the first occurrence of
the trigger, so that text cannot hold it) followed by one of the bodies of the structures it starts
(`begin` minus the trigger, `%json{schema}`, `end`); after the last tag, a final text that may not contain any
trigger (a regex intersected with the complement of "contains a trigger"). Without that last rule a trigger
could pass as plain text and the schema after it would never be enforced.

radixgen's extension for tool_choice required/named: `"only_tags": true` makes the output nothing but tags (at
least one, each a structure's full `begin`, document, `end`), separated by `"separator"` (default "\n");
`"max_tags": 1` allows just one. Only the llguidance backend compiles it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from runtime.constrained.errors import GrammarValidationError


@dataclass(frozen=True)
class Structure:
    begin: str
    schema: dict | bool
    end: str


@dataclass(frozen=True)
class StructuralTag:
    structures: list[Structure]
    triggers: list[str]
    only_tags: bool = False
    max_tags: int | None = None
    separator: str = "\n"

    def trigger_of(self, s: Structure) -> str:
        """The longest trigger `s.begin` starts with."""
        return max((t for t in self.triggers if s.begin.startswith(t)), key=len)


def parse_structural_tag(spec: str) -> StructuralTag:
    """Validate the spec's shape; GrammarValidationError naming the problem."""
    try:
        raw: Any = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarValidationError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("structures"), list) or not raw["structures"]:
        raise GrammarValidationError("structural_tag needs a non-empty 'structures' list of {begin, schema, end}")
    triggers = raw.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarValidationError("structural_tag needs a non-empty 'triggers' list of non-empty strings")
    structures = []
    for i, s in enumerate(raw["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarValidationError(f"structural_tag.structures[{i}] needs string 'begin' and 'end'")
        schema = s.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise GrammarValidationError(f"structural_tag.structures[{i}].schema must be a JSON schema object")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise GrammarValidationError(f"structural_tag.structures[{i}].begin {s['begin']!r} starts with none of "
                                         f"the triggers {triggers!r}"[:300])
        structures.append(Structure(s["begin"], schema, s["end"]))
    only, most, sep = raw.get("only_tags", False), raw.get("max_tags"), raw.get("separator", "\n")
    if not isinstance(only, bool) or not isinstance(sep, str) or most not in (None, 1):
        raise GrammarValidationError("structural_tag: only_tags is a boolean, max_tags 1 or absent, separator a "
                                     "string")
    return StructuralTag(structures, list(dict.fromkeys(triggers)), only, most, sep)


def _lit(s: str) -> str:
    return json.dumps(s)


def _rx(s: str) -> str:
    """A Lark /regex/ body matching `s` literally."""
    return re.escape(s).replace("/", "\\/")


def lark_grammar(tag: StructuralTag, schema_text: list[str]) -> str:
    """llguidance Lark text. schema_text[i]: structure i's schema as compact JSON (already rewritten by the
    caller's JSON rules)."""
    if tag.only_tags:
        return _only_tags(tag, schema_text)
    used = [t for t in tag.triggers if any(tag.trigger_of(s) == t for s in tag.structures)]
    contains = "|".join(_rx(t) for t in tag.triggers)
    lines = ["%llguidance {}", "start: tagged* TAIL", "tagged: " + " | ".join(f"tag_{k}" for k in range(len(used)))]
    for k, trig in enumerate(used):
        bodies = [i for i, s in enumerate(tag.structures) if tag.trigger_of(s) == trig]
        lines.append(f"trig_{k}[lazy]: TEXT {_lit(trig)}")
        lines.append(f"tag_{k}: trig_{k} (" + " | ".join(f"body_{i}" for i in bodies) + ")")
    for i, s in enumerate(tag.structures):
        rest = s.begin[len(tag.trigger_of(s)):]
        parts = [_lit(rest)] if rest else []
        parts.append(f"%json {schema_text[i]}")
        if s.end:
            parts.append(_lit(s.end))
        lines.append(f"body_{i}: " + " ".join(parts))
    lines.append("TEXT: /(.|\\n)*/")
    lines.append(f"TAIL: /(.|\\n)*/ & ~/(.|\\n)*({contains})(.|\\n)*/")
    return "\n".join(lines) + "\n"


def _only_tags(tag: StructuralTag, schema_text: list[str]) -> str:
    """Lark for an output of tags only: `full (separator full)*` (or one `full` under max_tags 1)."""
    rest = "" if tag.max_tags == 1 else f" ({_lit(tag.separator)} full)*"
    lines = ["%llguidance {}", "start: full" + rest,
             "full: " + " | ".join(f"body_{i}" for i in range(len(tag.structures)))]
    for i, s in enumerate(tag.structures):
        parts = [_lit(s.begin)] if s.begin else []
        parts.append(f"%json {schema_text[i]}")
        if s.end:
            parts.append(_lit(s.end))
        lines.append(f"body_{i}: " + " ".join(parts))
    return "\n".join(lines) + "\n"
