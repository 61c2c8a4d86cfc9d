"""Where a JSON schema may be narrowed, and the default caps on string length and array size.

Every rewrite here only narrows the set of documents a schema accepts, so a document generated under the
rewritten schema still validates against the user's schema. That holds for a subschema reached through
properties/items/allOf/anyOf/then/else/$ref..., and fails under `not` (narrowing the negated schema widens the
whole), `if` (it flips which branch applies), `oneOf` (a document two branches accepted, invalid under oneOf, can
match only one narrowed branch) and `contains` (with maxContains, fewer matches can pass): subschemas reached
through those are *tainted* and never narrowed. `plan` walks the schema from its root and follows local `$ref`s,
so a `$defs` entry is narrowed only if no tainted path reaches it.

Closing an object (`additionalProperties: false`) must also keep the schema satisfiable: other subschemas that
apply to the same instance (allOf branches, the parent of an anyOf branch, a $ref's siblings) may list or
require keys the object does not list. `plan` carries the keys those partners name; an object is closed only if
its own `properties` cover them (else closing would be a 400 "unsatisfiable", never a wrong 200).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

# The validation keywords of JSON Schema drafts 04 to 2020-12 (anything else is an annotation or an unknown
# keyword, which validators ignore too): json_rules.check_keywords refuses those a backend does not enforce; a
# subschema with none of them admits any value (runtime/constrained/json_any.py bounds those).
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "items", "additionalItems", "prefixItems", "maxItems",
    "minItems", "uniqueItems", "contains", "maxContains", "minContains", "maxProperties", "minProperties",
    "required", "properties", "patternProperties", "additionalProperties", "propertyNames", "dependencies",
    "dependentRequired", "dependentSchemas", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "unevaluatedItems", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef",
})

# Same instance, narrowing is monotone: all must hold (then/else: the one that applies must hold).
_CONJUNCTS_LISTS = ("allOf",)
_CONJUNCTS_ONE = ("then", "else")
# A new instance (a property value, an item, a key).
_CHILD_MAPS = ("properties", "patternProperties")
_CHILD_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedItems",
              "unevaluatedProperties", "prefixItems")
# Narrowing below these can widen what the whole schema accepts (see the module docstring).
_TAINT_ONE = ("not", "if", "contains")
_TAINT_LISTS = ("oneOf",)
_APPLICATORS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "dependentSchemas")


def ref_target(root: dict, ref: str) -> dict | None:
    """The subschema a local `$ref` names: `#`, `#/json/pointer`, or the root's own `$id`/`id` followed by one.
    None for anything else (other documents, anchors, the ids of subschemas)."""
    uri, _, frag = ref.partition("#")
    own = root.get("$id", root.get("id"))
    if uri and not (isinstance(own, str) and uri == own.partition("#")[0]):
        return None
    node: Any = root
    if frag and not frag.startswith("/"):
        return None
    for part in frag.split("/")[1:]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _as_list(v: Any) -> list[dict]:
    return [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, dict)]


@dataclass
class Plan:
    """Per subschema reached from the root (by id): whether a tainted path reaches it, and the keys that other
    subschemas on the same instance name (None: unknown)."""

    root: dict
    nodes: dict[int, dict] = field(default_factory=dict)
    tainted: set[int] = field(default_factory=set)
    partner_keys: dict[int, frozenset[str] | None] = field(default_factory=dict)
    unresolved: bool = False  # some $ref did not resolve: its target could be reached on a path not walked
    _keys_memo: dict[tuple[int, bool], frozenset[str] | None] = field(default_factory=dict)
    _in_progress: set[int] = field(default_factory=set)

    def keys(self, s: dict, skip_any_of: bool = False) -> frozenset[str] | None:
        """Property names `s` and the subschemas it applies to the same instance list or require (anyOf/oneOf
        branches included: any of them may be the one that holds; skip_any_of: not `s`'s own anyOf). None
        where a $ref does not resolve, is dynamic (not followed here) or leads back to `s` on the same instance
        (a schema no validator finishes). Memoized: the schema is not changed while a Plan is used."""
        memo_key = (id(s), skip_any_of)
        if memo_key in self._keys_memo:
            return self._keys_memo[memo_key]
        if id(s) in self._in_progress or "$dynamicRef" in s or "$recursiveRef" in s:
            return None
        self._in_progress.add(id(s))
        try:
            out = self._own_keys(s, skip_any_of)
        finally:
            self._in_progress.discard(id(s))
        self._keys_memo[memo_key] = out
        return out

    def _own_keys(self, s: dict, skip_any_of: bool) -> frozenset[str] | None:
        out: set[str] = set(s["properties"]) if isinstance(s.get("properties"), dict) else set()
        if isinstance(s.get("required"), list):
            out.update(k for k in s["required"] if isinstance(k, str))
        partners: list[dict] = []
        for k in ("dependentRequired", "dependencies"):
            for name, v in (s[k].items() if isinstance(s.get(k), dict) else ()):
                out.add(name)
                if isinstance(v, list):
                    out.update(x for x in v if isinstance(x, str))
                partners.extend(_as_list(v))
        if isinstance(s.get("dependentSchemas"), dict):
            out.update(s["dependentSchemas"])
            partners.extend(_as_list(list(s["dependentSchemas"].values())))
        for k in (*_CONJUNCTS_LISTS, "oneOf", *(() if skip_any_of else ("anyOf",)), *_CONJUNCTS_ONE):
            partners.extend(_as_list(s.get(k)))
        if isinstance(s.get("$ref"), str):
            target = ref_target(self.root, s["$ref"])
            if target is None:
                return None
            partners.append(target)
        for p in partners:
            sub = self.keys(p)
            if sub is None:
                return None
            out |= sub
        return frozenset(out)

    def narrowable(self) -> list[dict]:
        """Subschemas a rewrite may narrow (nothing when a $ref did not resolve)."""
        return [] if self.unresolved else [s for i, s in self.nodes.items() if i not in self.tainted]

    def closable(self) -> list[dict]:
        """Objects listing `properties` (and no other rule for extra keys) that may take additionalProperties:
        false: not tainted, and every key their same-instance partners name is one of their properties."""
        out = []
        for s in self.narrowable():
            props, outer = s.get("properties"), self.partner_keys.get(id(s))
            if not isinstance(props, dict) or outer is None or any(
                    k in s for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
                continue
            if isinstance(s.get("minProperties"), int) and s["minProperties"] > len(props):
                continue
            own = self.keys(s)
            if own is not None and (outer | own) <= props.keys():
                out.append(s)
        return out


def plan(root: dict) -> Plan:
    """Walk `root` through its subschemas and local $refs (see Plan)."""
    p = Plan(root)
    stack: list[tuple[dict, bool, frozenset[str] | None]] = [(root, False, frozenset())]
    while stack:
        s, tainted, outer = stack.pop()
        i = id(s)
        if i in p.nodes:  # walk again only if this path adds taint or keys
            old = p.partner_keys[i]
            merged = None if old is None or outer is None else old | outer
            if (i in p.tainted or not tainted) and merged == old:
                continue
            outer = merged
        p.nodes[i] = s
        p.partner_keys[i] = outer
        if tainted:
            p.tainted.add(i)
        tainted = i in p.tainted
        own = p.keys(s)
        group = None if outer is None or own is None else outer | own
        for k in _CHILD_MAPS:
            if isinstance(s.get(k), dict):
                stack.extend((x, tainted, frozenset()) for x in s[k].values() if isinstance(x, dict))
        for k in _CHILD_ONE:
            stack.extend((x, tainted, frozenset()) for x in _as_list(s.get(k)))
        for k in _CONJUNCTS_LISTS:
            stack.extend((x, tainted, group) for x in _as_list(s.get(k)))
        for k in _CONJUNCTS_ONE:
            stack.extend((x, tainted, group) for x in _as_list(s.get(k)))
        deps = [s.get("dependentSchemas"), s.get("dependencies")]
        for d in deps:
            if isinstance(d, dict):
                stack.extend((x, tainted, group) for x in _as_list(list(d.values())))
        # an anyOf branch shares the instance with its parent's other keywords, not with its sibling branches
        beside = p.keys(s, skip_any_of=True)
        branch_outer = None if outer is None or beside is None else outer | beside
        stack.extend((x, tainted, branch_outer) for x in _as_list(s.get("anyOf")))
        for k in _TAINT_ONE:
            stack.extend((x, True, None) for x in _as_list(s.get(k)))
        for k in _TAINT_LISTS:
            stack.extend((x, True, None) for x in _as_list(s.get(k)))
        if "$dynamicRef" in s or "$recursiveRef" in s:
            p.unresolved = True  # its target depends on the evaluation path: not followed
        if isinstance(s.get("$ref"), str):
            target = ref_target(root, s["$ref"])
            if target is None:
                p.unresolved = True
            else:
                stack.append((target, tainted, group))
    return p


def _types(s: dict) -> set[str] | None:
    """The instance types `s` names (None: no `type`, any type)."""
    t = s.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else None


_ECMA_ONLY = re.compile(r"\\[pP]\{[^}]*\}")


def pattern_width(pattern: str) -> tuple[int, int | None] | None:
    """(shortest, longest or None: unbounded) length of a string a schema `pattern` accepts, None if Python's
    parser cannot read it. JSON Schema patterns are unanchored: only a ^...$ pattern is bounded."""
    import re._parser as sre  # the stdlib's own regex parser (getwidth: min and max match width)

    text = _ECMA_ONLY.sub(".", pattern).replace("(?<", "(?P<").replace("(?P<=", "(?<=").replace("(?P<!", "(?<!")
    try:
        lo, hi = sre.parse(text).getwidth()
    except (re.error, OverflowError, RecursionError):
        return None
    anchored = pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")
    return lo, (hi if anchored and hi < sre.MAXREPEAT else None)


def _min(s: dict, key: str) -> int:
    v = s.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _string_cap(s: dict, cap: int, beside_patterns: bool, format_limits: dict[str, int]) -> int:
    """The maxLength to give the string subschema `s` (0: none). Never below its minLength or its pattern's
    shortest match, so the schema stays satisfiable."""
    cap = max(cap, _min(s, "minLength"))
    if "pattern" not in s and "format" not in s:
        return cap
    if not beside_patterns:
        return 0
    width = pattern_width(s["pattern"]) if isinstance(s.get("pattern"), str) else (0, None)
    if width is None or (width[1] is not None and width[1] <= cap):
        return 0  # unreadable, or already bounded by the pattern
    cap = max(cap, width[0])
    limit = format_limits.get(s["format"]) if isinstance(s.get("format"), str) else None
    return cap if limit is None else max(min(cap, limit), _min(s, "minLength"))


@dataclass(frozen=True)
class Caps:
    """Default caps (0: off). beside_patterns=False: strings with a pattern or a format get no cap (xgrammar
    drops a length there; llguidance's fallback when it cannot combine the two). untyped: a subschema without
    `type` gets the caps too (each applies only to its own type). max_properties: objects that admit unlisted
    keys (xgrammar does not enforce maxProperties: 0 there). free_depth: how many arrays/objects a free-form value
    (`{}`, `true`, an open object's extra values, untyped items) may nest once bounded (json_any; 0: left free).
    key_patterns: a free-form object's keys get at most max_string characters (a patternProperties; xgrammar
    has none)."""

    max_string: int = 0
    max_items: int = 0
    max_properties: int = 0
    beside_patterns: bool = True
    untyped: bool = True
    # 3 levels: with the server's defaults (closed objects, 256/32/32) it rejects none of MaskBench's 573 valid
    # documents that the caps alone accept (2 levels: 1 more, 1 level: 4 more); with extra properties allowed,
    # 8 more (1.4 %), all of them whole configs nested 4+ deep under an unlisted key (4 levels: 4 more).
    free_depth: int = 3
    key_patterns: bool = True


def cap_lengths(schema: dict, caps: Caps, format_limits: dict[str, int], where: Plan | None = None) -> None:
    """In place, on the narrowable subschemas (see `plan`): a string without maxLength, enum or const gets
    maxLength = max(caps.max_string, its minLength) (for a format with a standard limit, the smaller of that and
    the cap); an array without maxItems gets maxItems = max(caps.max_items, its minItems); an object that admits
    unlisted keys (additionalProperties not false, or patternProperties), has no maxProperties and whose instance
    has no optional listed property (its own or its partners') gets maxProperties = max(caps.max_properties, its minProperties, its required keys). A cap
    never goes below what the schema requires, so it never makes it unsatisfiable; beside a pattern it is at least
    the pattern's shortest match, and a ^...$ pattern that already bounds the length, or one Python cannot parse, gets none.
    A subschema with a `$ref` gets none (its target does; llguidance refuses keys beside a recursive $ref), nor
    does one without `type` that combines others (allOf/anyOf/oneOf/not/if: its branches do)."""
    if not (caps.max_string or caps.max_items or caps.max_properties):
        return
    where = where or plan(schema)
    for s in where.narrowable():
        types = _types(s)
        if "enum" in s or "const" in s or "$ref" in s:
            continue
        if types is None and (not caps.untyped or any(k in s for k in _APPLICATORS)):
            continue  # an untyped combination: its branches get the caps (keys beside a oneOf change llguidance's
            # reading of it)
        if caps.max_string and (types is None or "string" in types) and "maxLength" not in s:
            cap = _string_cap(s, caps.max_string, caps.beside_patterns, format_limits)
            if cap:
                s["maxLength"] = cap
        if caps.max_items and (types is None or "array" in types) and "maxItems" not in s:
            s["maxItems"] = max(caps.max_items, _min(s, "minItems"))
        if (caps.max_properties and (types is None or "object" in types) and "maxProperties" not in s
                and (s.get("additionalProperties") is not False or "patternProperties" in s)):
            required = {k for k in s["required"] if isinstance(k, str)} if isinstance(s.get("required"), list) else set()
            outer, own = where.partner_keys.get(id(s)), where.keys(s)
            # llguidance refuses maxProperties where a key listed on the instance (here, in an allOf/anyOf partner or
            # a $ref target) is optional, and the whole cap level fell back to no caps (MCPspec/Result, o69744)
            if outer is not None and own is not None and outer | own <= required:
                s["maxProperties"] = max(caps.max_properties, _min(s, "minProperties"), len(required))
