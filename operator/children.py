"""Make the live children match the rendered ones, touching only what differs.

Each rendered child carries a hash of itself in an annotation; a live child whose hash
matches is left alone, so a re-run or an operator restart issues no writes at all. Changes
go out as server-side apply (fields we stop setting are removed). Children this job owns
that are no longer rendered (a removed group, learners of a suspended job) are deleted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from diloco.operator import naming as n
from diloco.operator.kube import Kube

MANAGED_KINDS = ("ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "StatefulSet", "Deployment")
# Listed only where the operator may (the chart's syncerExposure.gatewayAPI): the CRD is optional.
GATEWAY_KINDS = ("GRPCRoute",)
# A claim's spec is immutable once bound (and resizing needs a cooperative storage class).
CREATE_ONLY = {"PersistentVolumeClaim"}

Key = tuple[str, str]  # (kind, name)


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with the hash of its own content in an annotation."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]
    meta = dict(obj["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), n.APPLIED_HASH: digest}
    return {**obj, "metadata": meta}


def key(obj: dict[str, Any]) -> Key:
    return obj["kind"], obj["metadata"]["name"]


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


@dataclass
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    delete: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> list[str]:
        return [f"applied {k}/{nm}" for k, nm in map(key, self.apply)] + \
               [f"deleted {k}/{nm}" for k, nm in map(key, self.delete)]


def plan(desired: list[dict[str, Any]], live: list[dict[str, Any]], owner_uid: str) -> Plan:
    """Pure: what to apply and what to delete so that `live` becomes `desired`."""
    out = Plan()
    live_by_key = {key(obj): obj for obj in live}
    wanted = {key(obj) for obj in desired}
    for obj in map(stamped, desired):
        current = live_by_key.get(key(obj))
        if current is None:
            out.apply.append(obj)
        elif obj["kind"] not in CREATE_ONLY:
            have = (current["metadata"].get("annotations") or {}).get(n.APPLIED_HASH)
            if have != obj["metadata"]["annotations"][n.APPLIED_HASH]:
                out.apply.append(obj)
    out.delete = [obj for k, obj in sorted(live_by_key.items()) if k not in wanted and owned_by(obj, owner_uid)]
    return out


def observe(kube: Kube, namespace: str, job: str,
            kinds: tuple[str, ...] = MANAGED_KINDS) -> dict[Key, dict[str, Any]]:
    """Every managed child of the job, as the API server has it."""
    out: dict[Key, dict[str, Any]] = {}
    for kind in kinds:
        for obj in kube.list(kind, namespace, n.selector(job)):
            out[key(obj)] = obj
    return out


def sync(kube: Kube, namespace: str, job: str, owner_uid: str, desired: list[dict[str, Any]],
         kinds: tuple[str, ...] = MANAGED_KINDS,
         live: dict[Key, dict[str, Any]] | None = None) -> tuple[dict[Key, dict[str, Any]], Plan]:
    """Apply the plan; returns the children (of `kinds`) as they are afterwards, and what was done.
    `live`: the children as the caller just observed them (else they are listed here)."""
    live = dict(live) if live is not None else observe(kube, namespace, job, kinds)
    todo = plan(desired, list(live.values()), owner_uid)
    for obj in todo.apply:
        live[key(obj)] = kube.apply(obj)
    for obj in todo.delete:
        kube.delete(obj["kind"], namespace, obj["metadata"]["name"], uid=obj["metadata"].get("uid"))
        live.pop(key(obj), None)
    return live, todo
