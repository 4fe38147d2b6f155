"""metav1.Condition lists, kept the way `kubectl wait --for=condition=...` expects.

A condition's lastTransitionTime changes only when its status flips, so a status written
every few seconds does not look like a flapping job. Reasons are CamelCase (API convention).
"""

from __future__ import annotations

from typing import Any

from diloco.spec import MAX_MESSAGE

CREATED, RUNNING, DEGRADED, SUSPENDED, SUCCEEDED, FAILED = (
    "Created", "Running", "Degraded", "Suspended", "Succeeded", "Failed")
# Set only once they first apply: a pod failing permanently (operator/failures/policy.py), a pod waiting for
# capacity (operator/failures/capacity.py), a child write the API server refused (operator/failures/refusals.py), a refused edit
# (operator/admission/immutable.py).
PODS_FAILING, PODS_UNSCHEDULABLE, CHILDREN_REFUSED, SPEC_REJECTED = (
    "PodsFailing", "PodsUnschedulable", "ChildrenRefused", "SpecRejected")
ORDER = (CREATED, RUNNING, DEGRADED, SUSPENDED, PODS_FAILING, PODS_UNSCHEDULABLE, CHILDREN_REFUSED, SPEC_REJECTED,
         SUCCEEDED, FAILED)

Condition = dict[str, Any]


def set_condition(conditions: list[Condition], type_: str, status: bool, *, reason: str, message: str,
                  now: str, generation: int) -> list[Condition]:
    """A new list with `type_` set; the others are kept, in a stable order. A message past
    metav1.Condition's limit is cut: the API server would refuse the whole status otherwise."""
    value = "True" if status else "False"
    old = find(conditions, type_)
    changed = old is None or old.get("status") != value
    new = {"type": type_, "status": value, "reason": reason, "message": message[:MAX_MESSAGE],
           "observedGeneration": generation,
           "lastTransitionTime": now if changed else old.get("lastTransitionTime", now)}  # type: ignore[union-attr]
    rest = [c for c in conditions if c.get("type") != type_]
    return sorted([*rest, new], key=lambda c: ORDER.index(c["type"]) if c["type"] in ORDER else len(ORDER))


def find(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: list[Condition], type_: str) -> bool:
    c = find(conditions, type_)
    return c is not None and c.get("status") == "True"
