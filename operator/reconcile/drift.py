"""Whether a live child still holds everything the operator set on it (hand edits are drift).

The hash annotation says what the operator last applied, not what the object holds now: a
`kubectl edit` of a StatefulSet's image or a ConfigMap's data leaves the hash as it was. So
each pass also checks that every field the operator renders is in the live object with the
same value. The API server adds defaults (extra fields are fine), drops empty values (omitempty) and writes
quantities canonically ("0.5" as "500m"); those are not drift. Fields a person added that the
operator never sets are left alone, as server-side apply leaves them.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
    "E": Decimal(10**18)}


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity's value ("500m", "1Gi", "2"), None if `value` is not one."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        return None
    text = str(value)
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number, scale = text[: -len(suffix)], _SUFFIXES[suffix]
            break
    else:
        number, scale = text, Decimal(1)
    try:
        return Decimal(number) * scale
    except InvalidOperation:
        return None


def _empty(value: Any) -> bool:
    """What the server omits (omitempty): null, {}, [], "", false and 0."""
    return value is None or value is False or (not isinstance(value, bool) and value in ({}, [], "", 0))


def contains(live: Any, desired: Any) -> bool:
    """Every field of `desired` is in `live` with an equal value (see the module docstring)."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return _empty(desired) and _empty(live)
        return all(contains(live.get(k), v) if k in live else _empty(v) for k, v in desired.items())
    if isinstance(desired, list):
        if _empty(desired) and _empty(live):
            return True
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    if live == desired:
        return True
    if isinstance(desired, str) and isinstance(live, str | int) and not isinstance(live, bool):
        a, b = quantity(live), quantity(desired)
        return a is not None and a == b
    return False


def drifted(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether `live` lost something of `desired`: its labels, annotations and content (spec,
    data, ...). apiVersion is the server's to choose (an older one may serve the kind) and
    owner references are the garbage collector's business."""
    meta, have = desired.get("metadata") or {}, live.get("metadata") or {}
    content = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    return not (contains(have.get("labels") or {}, meta.get("labels") or {})
                and contains(have.get("annotations") or {}, meta.get("annotations") or {})
                and contains(live, content))
