"""Bounded "any JSON" for free-form values: the caps of json_caps at every level of a value the schema leaves free.

A subschema that admits any value (`{}`, `true`, one holding annotations only), the extra values of an object that
stays open (additionalProperties absent or `true`) and the items of an array without `items` are compiled by
llguidance and xgrammar as unbounded JSON; at temperature 0.8 SmolLM2 ran on inside them until max_tokens (an
extra property's number "1616...", a string, an untyped array's keys `":1,":1,...`). Where json_caps' plan lets
the schema be narrowed and the caps are on, `bound_free_values` makes each of them `any_value(caps, depth)`.

Every rewrite narrows (a document valid under `any_value` is valid under `{}`); it must also not conflict with
what other subschemas say about the same value (an allOf partner listing deep properties there would leave no
document, or only shallow ones), so a value is bounded only where it is *alone*: every way to reach it is a
child position (a property value, items, prefixItems, additionalProperties) of an alone subschema whose other
same-instance subschemas (allOf/anyOf branches, $ref targets...) name no schema for that position, or a `$ref` /
`anyOf` that is all its referring subschema says (`{"$ref": ...}`, `{"anyOf": [...]}`), from an alone subschema;
the root is alone unless reached otherwise. An open object's extra values are bounded with the keys its
same-instance partners name listed as `true`, so those keep their partners' schemas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.constrained.json_caps import VALIDATION_KEYWORDS, Caps, Plan, _types, ref_target

_SAME_INSTANCE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")
_ITEM_KEYS = ("items", "prefixItems", "additionalItems", "unevaluatedItems", "contains")
_EXTRA_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_APPLICATORS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "dependentSchemas", "dependencies")
_OBJECT_KEYS = ("properties", "additionalProperties", "patternProperties", "required", "minProperties",
                "maxProperties", "propertyNames", "dependentRequired")
_OTHER_CHILDREN = ("patternProperties", "additionalItems", "propertyNames", "unevaluatedItems",
                   "unevaluatedProperties", "contains")


def any_value(caps: Caps, depth: int, inner: Callable[[int], dict] | None = None) -> dict:
    """Any JSON value within the caps, nesting at most `depth` arrays/objects: null, boolean, number (llguidance:
    bound_numbers gives it the fraction and I-JSON bounds), string of at most max_string characters, array of at
    most max_items values any_value(depth - 1), object of at most max_properties keys (of at most max_string
    characters where caps.key_patterns) with values any_value(depth - 1). A cap of 0 leaves that size free.
    inner(d): the subschema to use for any_value(d) one level down (default: an inline copy)."""
    def below() -> dict:
        return inner(depth - 1) if inner else any_value(caps, depth - 1)

    out: dict[str, Any] = {"type": ["null", "boolean", "number", "string", *(["array", "object"] if depth else [])]}
    if caps.max_string:
        out["maxLength"] = caps.max_string
    if depth:
        if caps.max_items:
            out["maxItems"] = caps.max_items
        out["items"] = below()
        if caps.max_properties:
            out["maxProperties"] = caps.max_properties
        if caps.key_patterns and caps.max_string:
            out["patternProperties"] = {f"^.{{0,{caps.max_string}}}$": below()}
            out["additionalProperties"] = False
        else:
            out["additionalProperties"] = below()
    return out


def _maker(where: Plan, caps: Caps) -> Callable[[], dict]:
    """What each bounded position gets: a `$ref` to one copy of each level under the root's `$defs` (llguidance
    compiles a definition once; inline copies made its grammar text up to 40x larger and compiles ~1 s slower),
    or an inline copy where a subschema below the root has an `$id` (a `$ref` under it resolves against that)."""
    if not isinstance(where.root.get("$defs", {}), dict) or any(
            isinstance(s.get("$id", s.get("id")), str) for s in where.nodes.values() if s is not where.root):
        return lambda: any_value(caps, caps.free_depth)
    defs = where.root.setdefault("$defs", {})
    name = "radixgen_any"
    while any(f"{name}_{d}" in defs for d in range(caps.free_depth + 1)):
        name += "_"
    for d in range(caps.free_depth + 1):
        defs[f"{name}_{d}"] = any_value(caps, d, lambda k: {"$ref": f"#/$defs/{name}_{k}"})
    return lambda: {"$ref": f"#/$defs/{name}_{caps.free_depth}"}


def free(x: Any) -> bool:
    """Whether a subschema admits any value: `true`, or an object without validation keywords."""
    return x is True or (isinstance(x, dict) and not any(k in VALIDATION_KEYWORDS for k in x))


def _links(root: dict, s: dict) -> list[tuple[str, dict]]:
    """(keyword, subschema) for the subschemas `s` applies to its own instance."""
    out = [(k, x) for k in _SAME_INSTANCE for x in (s[k] if isinstance(s.get(k), list) else [s.get(k)])
           if isinstance(x, dict)]
    for k in ("dependentSchemas", "dependencies"):
        if isinstance(s.get(k), dict):
            out.extend((k, x) for x in s[k].values() if isinstance(x, dict))
    target = ref_target(root, s["$ref"]) if isinstance(s.get("$ref"), str) else None
    return out + [("$ref", target)] if target is not None else out


def _positions(s: dict) -> list[tuple[tuple[str, ...], Any, Any]]:
    """(slot, container, key) for each new-instance subschema container[key] of `s` (dict or bool): slot
    ("prop", name), ("extra",), ("item",), or ("other",) for the positions never bounded here."""
    out: list[tuple[tuple[str, ...], Any, Any]] = []
    if isinstance(s.get("properties"), dict):
        out.extend((("prop", k), s["properties"], k) for k in s["properties"])
    if "additionalProperties" in s:
        out.append((("extra",), s, "additionalProperties"))
    items = s.get("items")
    out.extend([(("item",), items, i) for i in range(len(items))] if isinstance(items, list)
               else [(("item",), s, "items")] if "items" in s else [])
    if isinstance(s.get("prefixItems"), list):
        out.extend((("item",), s["prefixItems"], i) for i in range(len(s["prefixItems"])))
    for k in _OTHER_CHILDREN:
        v = s.get(k)
        if isinstance(v, dict) and k == "patternProperties":
            out.extend((("other",), v, n) for n in v)
        elif isinstance(v, list):
            out.extend((("other",), v, i) for i in range(len(v)))
        elif k in s:
            out.append((("other",), s, k))
    return out


class _Alone:
    """Which narrowable subschemas of a plan are alone on their instance (see the module docstring)."""

    def __init__(self, where: Plan) -> None:
        self.where = where
        self._below: dict[int, list[dict]] = {}
        ins: dict[int, list[tuple[int, tuple[str, ...] | str]]] = {}
        outs: dict[int, list[int]] = {}
        for i, s in where.nodes.items():
            for kw, t in _links(where.root, s):
                ins.setdefault(id(t), []).append((i, kw))
                outs.setdefault(i, []).append(id(t))
            for slot, box, key in _positions(s):
                if isinstance(box[key], dict):
                    ins.setdefault(id(box[key]), []).append((i, slot))
                    outs.setdefault(i, []).append(id(box[key]))
        # the largest set closed under the rule: drop a subschema with an in-edge that fails it, recheck its
        # successors (a cycle of $refs on one instance is left alone: no validator finishes it either)
        self.ids = {i for i in where.nodes if i not in where.tainted}
        work = list(self.ids)
        while work:
            i = work.pop()
            if i in self.ids and not all(self._edge_ok(p, how) for p, how in ins.get(i, ())):
                self.ids.discard(i)
                work.extend(outs.get(i, ()))

    def below(self, i: int) -> list[dict]:
        """The subschemas applied to node i's instance through it (allOf/anyOf/... branches, $ref targets),
        transitively, not node i itself."""
        if i not in self._below:
            seen, out, stack = {i}, [], [self.where.nodes[i]]
            while stack:
                for _, t in _links(self.where.root, stack.pop()):
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append(t)
                        stack.append(t)
            self._below[i] = out
        return self._below[i]

    def partnered(self, i: int, slot: tuple[str, ...]) -> bool:
        """Whether a subschema on node i's instance other than node i names a schema for position `slot`."""
        s, group = self.where.nodes[i], self.below(i)
        if slot[0] == "prop":
            return "patternProperties" in s or any(
                any(k in n for k in _EXTRA_KEYS) or slot[1] in (n.get("properties") or {}) for n in group)
        if slot[0] == "extra":  # partners' listed keys are exempted instead (bound_free_values)
            return any(k in n for n in group for k in _EXTRA_KEYS)
        if slot[0] == "item":
            return "contains" in s or any(k in n for n in group for k in _ITEM_KEYS)
        return True

    def _edge_ok(self, p: int, how: tuple[str, ...] | str) -> bool:
        if p not in self.ids:
            return False
        if isinstance(how, tuple):
            return not self.partnered(p, how)
        s = self.where.nodes[p]
        says = {k for k in s if k in VALIDATION_KEYWORDS}
        return says == {how} and (how in ("$ref", "anyOf") or (how == "allOf" and len(s["allOf"]) == 1))


def _named_keys(group: list[dict]) -> set[str]:
    out: set[str] = set()
    for n in group:
        out.update(n["properties"] if isinstance(n.get("properties"), dict) else ())
        out.update(k for k in (n["required"] if isinstance(n.get("required"), list) else ()) if isinstance(k, str))
        for k in ("dependentRequired", "dependencies"):
            for name, v in (n[k].items() if isinstance(n.get(k), dict) else ()):
                out.add(name)
                out.update(x for x in (v if isinstance(v, list) else ()) if isinstance(x, str))
    return out


def bound_free_values(where: Plan, caps: Caps) -> None:
    """In place, on the alone narrowable subschemas of `where` (see the module docstring): a free-form subschema
    (`free`) becomes any_value(caps, caps.free_depth) (a `true` one is replaced by it); an object that admits
    extra keys (additionalProperties absent, `true` or free; no unevaluatedProperties) gets them as that value,
    its partners' named keys listed as `true`; an array typed as such without `items` gets items of that value.
    Nothing when the caps are off, free_depth is 0 or a $ref did not resolve."""
    if not caps.free_depth or not (caps.max_string or caps.max_items or caps.max_properties):
        return
    if where.unresolved:
        return
    alone = _Alone(where)
    extra_ids = {id(s["additionalProperties"]) for s in where.nodes.values() if isinstance(
        s.get("additionalProperties"), dict)}  # bounded with their object's exemptions, below
    dicts = [s for i, s in where.nodes.items() if i in alone.ids and free(s) and i not in extra_ids]
    trues: list[tuple[Any, Any]] = []
    extras: list[tuple[dict, set[str]]] = []
    arrays: list[dict] = []
    for i in alone.ids:
        s = where.nodes[i]
        types = _types(s)
        if free(s) or "$ref" in s:
            continue
        for slot, box, key in _positions(s):
            if box[key] is True and slot[0] in ("prop", "item") and not alone.partnered(i, slot):
                trues.append((box, key))
        extra = s.get("additionalProperties", True)
        objecty = "object" in types if types is not None else (
            not any(k in s for k in _APPLICATORS) and any(k in s for k in _OBJECT_KEYS))
        if (objecty and "unevaluatedProperties" not in s and (extra is True or (free(extra) and id(extra) in alone.ids))
                and not alone.partnered(i, ("extra",))):
            extras.append((s, _named_keys(alone.below(i)) - set(s.get("properties") or ())))
        if (types is not None and "array" in types and "items" not in s and not alone.partnered(i, ("item",))
                and not any(k in s for k in ("contains", "unevaluatedItems", "additionalItems"))):
            arrays.append(s)
    if not (dicts or trues or extras or arrays):
        return
    value = _maker(where, caps)  # after the walk: it may add the shared copy under the root's $defs
    for s in dicts:
        s.update(value())
    for box, key in trues:
        box[key] = value()
    for s, exempt in extras:
        if exempt:
            s["properties"] = {**(s.get("properties") or {}), **{k: True for k in sorted(exempt)}}
        if caps.key_patterns and caps.max_string and not s.get("properties") and "patternProperties" not in s:
            s["patternProperties"] = {f"^.{{0,{caps.max_string}}}$": value()}  # a map: its keys are free too
            s["additionalProperties"] = False
        elif s.get("additionalProperties", True) is True:
            s["additionalProperties"] = value()
        else:
            s["additionalProperties"].update(value())
    for s in arrays:
        s["items"] = value()


def free_root(caps: Caps) -> dict:
    """The schema `true` (any JSON document) bounded as a free-form value."""
    return any_value(caps, caps.free_depth)
