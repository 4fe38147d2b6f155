"""CRD validation rules (`x-kubernetes-validations`) evaluated as a Kubernetes 1.25+ API server
does, with cel-python (PyPI `cel-python`, pure Python), for servers that drop them (1.20).

`errors(schema, new, old)` walks a CRD's structural schema beside the object: at each node that
is present, every rule runs with `self` bound to that node's value (as JSON) and, on an update,
`oldSelf` to the old value at the same place. As in Kubernetes (apiextensions-apiserver's
pkg/apiserver/schema/cel/validation.go): a transition rule (one that names `oldSelf`) runs only
on an update and only where the old object has a correlatable value: object properties by name,
map values by key, items of a `x-kubernetes-list-type: map` list by their keys (items of other
lists have no old value); a rule that evaluates to false, or fails to evaluate, refuses the write
with the rule's message at the node's path. What the schema alone says (types, bounds,
patterns) is the API server's own job here and is not repeated.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from typing import Any

import celpy

_ENV = celpy.Environment()
_MACROS = {"all", "exists", "exists_one", "map", "filter"}


@functools.lru_cache(maxsize=2048)
def _program(rule: str) -> Any:
    return _ENV.program(_ENV.compile(rule))


def _bound(value: Any, rules: str, name: str) -> Any:
    """`value` as CEL sees it, once for all the rules of a node (`rules`, their text). Of an
    object, only the fields the rules read by name are converted (the Workload's root rules name
    spec and status, not metadata); rules that use the variable whole (`self == oldSelf`,
    `size(self)`, a macro) get all of it."""
    fields = set(re.findall(rf"\b{name}\.(\w+)", rules))
    if isinstance(value, dict) and not re.search(rf"\b{name}\b(?!\.\w)", rules) and not fields & _MACROS:
        value = {k: v for k, v in value.items() if k in fields}
    return celpy.json_to_cel(value)


def _mentions_old(rule: str) -> bool:
    return "oldSelf" in rule


def _item_key(schema: Mapping[str, Any], item: Any) -> tuple[Any, ...] | None:
    keys = schema.get("x-kubernetes-list-map-keys") or []
    if schema.get("x-kubernetes-list-type") != "map" or not keys or not isinstance(item, dict):
        return None
    return tuple(item.get(k) for k in keys)


def _walk(schema: Mapping[str, Any], new: Any, old: Any, path: str, has_old: bool) -> Iterator[str]:
    found = schema.get("x-kubernetes-validations") or []
    texts = " ".join(rule["rule"] for rule in found)
    bound = {"self": _bound(new, texts, "self"), **({"oldSelf": _bound(old, texts, "oldSelf")} if has_old else {})} \
        if found else {}
    for rule in found:
        text = rule["rule"]
        if _mentions_old(text) and not has_old:
            continue
        activation = bound if _mentions_old(text) else {"self": bound["self"]}
        message = rule.get("message") or f"failed rule: {text}"
        try:
            ok = _program(text).evaluate(activation)
        except Exception as exc:  # an evaluation error refuses the write, as in Kubernetes
            yield f"{path or '<root>'}: Invalid value: \"object\": {message} (evaluation error: {exc})"
            continue
        if isinstance(ok, celpy.CELEvalError):
            yield f"{path or '<root>'}: Invalid value: \"object\": {message} (evaluation error: {ok})"
        elif not bool(ok):
            yield f"{path or '<root>'}: Invalid value: \"object\": {message}"
    if isinstance(new, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name in new:
                there = has_old and isinstance(old, dict) and name in old
                yield from _walk(sub, new[name], old.get(name) if there else None, f"{path}.{name}".lstrip("."),
                                 there)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, value in new.items():
                if name in props:
                    continue
                there = has_old and isinstance(old, dict) and name in old
                yield from _walk(extra, value, old.get(name) if there else None, f"{path}[{name}]", there)
    if isinstance(new, list) and isinstance(schema.get("items"), dict):
        olds = {}
        if has_old and isinstance(old, list):
            olds = {k: item for item in old if (k := _item_key(schema, item)) is not None}
        for i, item in enumerate(new):
            key = _item_key(schema, item)
            there = key is not None and key in olds
            yield from _walk(schema["items"], item, olds.get(key) if there else None, f"{path}[{i}]", there)


def errors(schema: Mapping[str, Any], new: Any, old: Any = None) -> list[str]:
    """The rules of `schema` (a CRD version's openAPIV3Schema) that `new` breaks; `old`: the
    object before an update (None on create)."""
    return list(_walk(schema, new, old, "", old is not None))


def rules(schema: Mapping[str, Any]) -> int:
    """How many rules a schema holds (the gate says what it enforces)."""
    count = len(schema.get("x-kubernetes-validations") or [])
    for sub in (schema.get("properties") or {}).values():
        count += rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            count += rules(schema[key])
    return count
