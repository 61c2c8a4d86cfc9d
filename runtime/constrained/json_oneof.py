"""`oneOf` as `anyOf` where its branches provably exclude each other.

oneOf accepts a value exactly one branch accepts; when no value is accepted by two branches, that is anyOf, which
llguidance and xgrammar enforce (llguidance refuses a oneOf it cannot prove exclusive itself, and its own proof
does not look through `$ref` or at keys). The proof runs per JSON type (null, boolean, number, string, array,
object). On each type the branches that accept something of it must pairwise exclude each other, or at least two
of them must accept *every* value of that type: then oneOf accepts none of it and no branch may produce it. Two
branches exclude each other on a type when
- their const/enum values (through allOf and `$ref`) have none in common, or
- (objects) one requires a key the other forbids (`false`, or closed without listing it), or a key one requires
  has values the two keep apart (the same test, one level down, bounded).
Whatever is not proved leaves the oneOf as it was, and the backend refuses it with its own message. The
rewrite only renames the keyword and narrows branches to the types they keep, so schemas narrowed after it
(runtime/constrained/json_caps.py: caps, closed objects) stay exclusive: narrowing a branch cannot make two
branches share a value.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.constrained.json_caps import VALIDATION_KEYWORDS, ref_target

TYPES = ("null", "boolean", "number", "string", "array", "object")
NONE, SOME, ALL = 0, 1, 2  # what a schema accepts of one type: nothing, some values (or unknown), every value
_DEPTH = 6  # $ref hops and key levels followed in one proof

# The type a keyword constrains (a value of another type passes it untouched).
_TYPED = {k: t for t, ks in {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains", "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
               "unevaluatedProperties"),
}.items() for k in ks}

Acc = dict[str, int]


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(v), "null")


def _key(v: Any) -> str:
    """Equality as JSON Schema's enum/const sees it (1 == 1.0; true != 1)."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return json.dumps(v, sort_keys=True)


class _Prover:
    def __init__(self, root: dict) -> None:
        self.root = root
        self._acc: dict[int, Acc] = {}  # by id(): schemas are shared through $ref, the proof revisits them

    def _deref(self, s: dict, depth: int) -> dict | None:
        ref = s.get("$ref")
        return ref_target(self.root, ref) if isinstance(ref, str) and depth < _DEPTH else None

    def accepts(self, s: Any, depth: int = 0) -> Acc:
        """Per type: NONE (exact), ALL (exact) or SOME (some values, or not known)."""
        if isinstance(s, dict) and id(s) not in self._acc:
            self._acc[id(s)] = self._accepts(s, depth) if depth <= 4 * _DEPTH else dict.fromkeys(TYPES, SOME)
        return self._acc[id(s)] if isinstance(s, dict) else self._accepts(s, depth)

    def _accepts(self, s: Any, depth: int) -> Acc:
        if s is True or (isinstance(s, dict) and not any(k in VALIDATION_KEYWORDS for k in s)):
            return dict.fromkeys(TYPES, ALL)
        if not isinstance(s, dict):
            return dict.fromkeys(TYPES, NONE if s is False else SOME)
        acc = dict.fromkeys(TYPES, ALL)

        def meet(other: Acc) -> None:
            for t in TYPES:
                acc[t] = min(acc[t], other[t])

        t = s.get("type")
        if t is not None:
            named = set(t if isinstance(t, list) else [t])
            meet({x: ALL if x in named else SOME if x == "number" and "integer" in named else NONE for x in TYPES})
        if "enum" in s or "const" in s:
            vals = s["enum"] if isinstance(s.get("enum"), list) else []
            kinds = {json_type(v) for v in vals + ([s["const"]] if "const" in s else [])}
            if "const" in s and "enum" in s:
                kinds &= {json_type(s["const"])}
            meet({x: SOME if x in kinds else NONE for x in TYPES})
        for k in s:
            if k in _TYPED:
                acc[_TYPED[k]] = min(acc[_TYPED[k]], SOME)
        if "$ref" in s:
            target = self._deref(s, depth)
            meet(self.accepts(target, depth + 1) if target is not None else dict.fromkeys(TYPES, SOME))
        for b in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            meet(self.accepts(b, depth + 1))
        for key, join in (("anyOf", max), ("oneOf", None)):
            if isinstance(s.get(key), list) and s[key]:
                subs = [self.accepts(b, depth + 1) for b in s[key]]
                # oneOf: nothing if no branch takes the type, else not known (two ALL branches would be nothing)
                meet({x: join(a[x] for a in subs) if join else min(SOME, max(a[x] for a in subs)) for x in TYPES})
        if "not" in s:
            neg = self.accepts(s["not"], depth + 1)
            meet({x: {ALL: NONE, NONE: ALL}.get(neg[x], SOME) for x in TYPES})
        if any(k in s for k in ("if", "$dynamicRef", "$recursiveRef")):
            meet(dict.fromkeys(TYPES, SOME))
        return acc

    def values(self, s: Any, depth: int = 0) -> set[str] | None:
        """The values `s` admits when that set is finite and known (enum/const, through allOf and $ref)."""
        if not isinstance(s, dict) or depth > _DEPTH:
            return None
        out: set[str] | None = None

        def meet(vs: set[str] | None) -> None:
            nonlocal out
            if vs is not None:
                out = vs if out is None else out & vs
        if isinstance(s.get("enum"), list):
            meet({_key(v) for v in s["enum"]})
        if "const" in s:
            meet({_key(s["const"])})
        if "$ref" in s:
            meet(self.values(self._deref(s, depth), depth + 1))
        for b in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            meet(self.values(b, depth + 1))
        return out

    def _conjuncts(self, s: Any, depth: int = 0) -> list[dict]:
        """`s` and the subschemas that apply to the same instance as all of it (allOf, $ref)."""
        if not isinstance(s, dict) or depth > _DEPTH:
            return []
        out = [s]
        target = self._deref(s, depth)
        out += self._conjuncts(target, depth + 1) if target is not None else []
        for b in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            out += self._conjuncts(b, depth + 1)
        return out

    @staticmethod
    def _value_schema(s: dict, key: str) -> Any:
        """The schema `s` puts on the value of `key` (False: the key is forbidden; None: not known)."""
        props = s["properties"] if isinstance(s.get("properties"), dict) else {}
        if key in props:
            return props[key]
        if "patternProperties" in s:
            return None
        return s.get("additionalProperties", True)

    def _keys_apart(self, a: Any, b: Any, depth: int) -> bool:
        """Some key every object `a` accepts has cannot have a value `b` accepts."""
        ca, cb = self._conjuncts(a), self._conjuncts(b)
        required = {k for s in ca if isinstance(s.get("required"), list) for k in s["required"] if isinstance(k, str)}
        for key in required:
            for sb in cb:
                vb = self._value_schema(sb, key)
                if vb is False:
                    return True
                if vb is None or vb is True:
                    continue
                for sa in ca:
                    va = self._value_schema(sa, key)
                    if va not in (None, True) and self.disjoint(va, vb, depth + 1):
                        return True
        return False

    def _objects_apart(self, a: Any, b: Any, depth: int) -> bool:
        """No object is accepted by both: keys apart, or every branch of an anyOf/oneOf that one of them
        applies is apart from the other."""
        if depth > _DEPTH:
            return False
        if self._keys_apart(a, b, depth) or self._keys_apart(b, a, depth):
            return True
        for x, y in ((a, b), (b, a)):
            for sx in self._conjuncts(x):
                for k in ("anyOf", "oneOf"):
                    branches = sx.get(k)
                    if isinstance(branches, list) and branches and all(
                            self.accepts(br)["object"] == NONE or self._objects_apart(br, y, depth + 1)
                            for br in branches):
                        return True
        return False

    def apart_on(self, a: Any, b: Any, t: str, depth: int) -> bool:
        """No value of type `t` is accepted by both (False: not proved)."""
        va, vb = self.values(a), self.values(b)
        if va is not None and vb is not None and not {v for v in va & vb if json_type(json.loads(v)) == t}:
            return True
        return t == "object" and self._objects_apart(a, b, depth)

    def disjoint(self, a: Any, b: Any, depth: int = 0) -> bool:
        if depth > _DEPTH:
            return False
        aa, ab = self.accepts(a), self.accepts(b)
        return all(aa[t] == NONE or ab[t] == NONE or self.apart_on(a, b, t, depth) for t in TYPES)


def exclusive_branches(root: dict, node: dict) -> list[Any] | None:
    """`node`'s oneOf branches as anyOf branches (each narrowed to the types it may produce), or None if they
    are not provably exclusive. Types `node` itself excludes (its `type`) need no proof."""
    branches = node["oneOf"]
    p = _Prover(root)
    own = p.accepts({"type": node["type"]}) if "type" in node else dict.fromkeys(TYPES, ALL)
    accs = [p.accepts(b) for b in branches]
    keep: list[set[str]] = [{t for t in TYPES if a[t] != NONE} for a in accs]
    for t in TYPES:
        takers = [i for i, a in enumerate(accs) if a[t] != NONE]
        if own[t] == NONE or len(takers) < 2:
            continue
        if sum(accs[i][t] == ALL for i in takers) >= 2:  # every value of t matches two branches: oneOf takes none
            for i in takers:
                keep[i].discard(t)
            continue
        if not all(p.apart_on(branches[i], branches[j], t, 0) for i in takers for j in takers if i < j):
            return None
    out: list[Any] = []
    for b, a, kept in zip(branches, accs, keep, strict=True):
        if kept == {t for t in TYPES if a[t] != NONE}:
            out.append(b)
        elif kept:
            out.append({"allOf": [b], "type": [t for t in TYPES if t in kept]})
    return out or [False]  # a branch left no type adds nothing to anyOf
