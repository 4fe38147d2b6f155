"""Make the live children match the rendered ones, touching only what differs.

Each rendered child carries a hash of itself in an annotation; a live child whose hash
matches, and still holds every field it was rendered with, is left alone, so a re-run or an
operator restart issues no writes at all, while a hand edit is put back on the next pass. Changes
go out as server-side apply (fields we stop setting are removed). Children this job owns
that are no longer rendered (a removed group, pods of a suspended job) are deleted (PRUNABLE
kinds only); what it does not own (a retained checkpoint volume) never is. A write the API
server refuses (a quota, a webhook, RBAC: operator/failures/refusals.py) is recorded and the others still go out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from diloco.operator.failures import refusals
from diloco.operator.kube import ApiError, Kube
from diloco.operator.kueue.integration import FINALIZER as KUEUE_FINALIZER
from diloco.operator.reconcile import drift
from diloco.operator.render import naming as n

MANAGED_KINDS = ("ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "StatefulSet", "Deployment",
                 "NetworkPolicy", "PodDisruptionBudget")
# Listed only where the operator may (the chart's syncerExposure.gatewayAPI): the CRD is optional.
GATEWAY_KINDS = ("GRPCRoute",)
# Likewise only with the chart's kueue.enabled: a queued job's Kueue Workload (operator/kueue/integration.py).
KUEUE_KINDS = ("Workload",)
OPTIONAL_KINDS = frozenset(GATEWAY_KINDS + KUEUE_KINDS)
# A claim's spec is immutable once bound (and resizing needs a cooperative storage class).
CREATE_ONLY = {"PersistentVolumeClaim"}
# What may stop being rendered while its job exists (suspended, finished, a group removed, an
# exposure dropped), so what the operator deletes. The rest (config, token, checkpoint claim,
# network policy) lives as long as the job and goes with it through the garbage collector (a
# retained claim outlives it), so the operator needs no right to delete Secrets or claims.
PRUNABLE = {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "GRPCRoute", "Workload"}

Key = tuple[str, str]  # (kind, name)
# Finalizers the operator itself puts on children of a kind, taken off before it deletes one:
# Kueue's on the Workloads it writes as the job's integration (operator/kueue/integration.py).
OWN_FINALIZERS = {"Workload": KUEUE_FINALIZER}


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
    refused: list[refusals.Refusal] = field(default_factory=list)  # what the API server refused (sync)

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
            if have != obj["metadata"]["annotations"][n.APPLIED_HASH] or drift.drifted(current, obj):
                out.apply.append(obj)  # changed by us, or edited by hand since (operator/reconcile/drift.py)
    out.delete = [obj for k, obj in sorted(live_by_key.items())
                  if k not in wanted and k[0] in PRUNABLE and owned_by(obj, owner_uid)]
    return out


def remove(kube: Kube, namespace: str, obj: dict[str, Any]) -> bool:
    """Delete a child, our own finalizer on it (OWN_FINALIZERS) taken off first, guarded by its
    resourceVersion, so it goes at once; False when that lost a race (the next pass sees it again)."""
    mine, md = OWN_FINALIZERS.get(obj["kind"]), obj["metadata"]
    finalizers = list(md.get("finalizers") or [])
    if mine is not None and mine in finalizers:
        try:
            kube.patch(obj["kind"], namespace, md["name"], {"metadata": {
                "resourceVersion": md.get("resourceVersion"), "finalizers": [f for f in finalizers if f != mine]}})
        except ApiError as exc:
            if exc.status == 404:
                return True
            if exc.status != 409:
                raise
            return False
    kube.delete(obj["kind"], namespace, md["name"], uid=md.get("uid"))
    return True


def observe(kube: Kube, namespace: str, job: str,
            kinds: tuple[str, ...] = MANAGED_KINDS) -> dict[Key, dict[str, Any]]:
    """Every managed child of the job, as the API server has it."""
    out: dict[Key, dict[str, Any]] = {}
    for kind in kinds:
        if kind == "Secret":
            # Read by name, never listed: RBAC cannot narrow a list by label, so `list secrets`
            # would let the operator read every Secret in the namespace. The job's token is the
            # only Secret it creates.
            obj = kube.get(kind, namespace, n.token_secret(job))
            if obj is not None and n.selector(job).items() <= (obj["metadata"].get("labels") or {}).items():
                out[key(obj)] = obj
            continue
        try:
            found = kube.list(kind, namespace, n.selector(job))
        except ApiError as exc:
            # An optional kind whose API is not served (Kueue or the Gateway API not installed,
            # or only in versions the operator does not speak): no children of it, and the jobs
            # that need it say so themselves (operator/kueue/integration.py, operator/render/exposure.py).
            if exc.status != 404 or kind not in OPTIONAL_KINDS:
                raise
            continue
        for obj in found:
            out[key(obj)] = obj
    return out


def sync(kube: Kube, namespace: str, job: str, *, owner_uid: str, desired: list[dict[str, Any]],
         kinds: tuple[str, ...] = MANAGED_KINDS,
         live: dict[Key, dict[str, Any]] | None = None) -> tuple[dict[Key, dict[str, Any]], Plan]:
    """Apply the plan; returns the children (of `kinds`) as they are afterwards, and what was done
    (with the writes the API server refused). `live`: the children as the caller just observed
    them (else they are listed here)."""
    live = dict(live) if live is not None else observe(kube, namespace, job, kinds)
    todo, done = plan(desired, list(live.values()), owner_uid), Plan()
    for obj in todo.apply:
        try:
            live[key(obj)] = kube.apply(obj)
        except ApiError as exc:
            if not refusals.refused(exc):
                raise
            done.refused.append(refusals.of(obj, "update" if key(obj) in live else "create", exc))
            continue
        done.apply.append(obj)
    for obj in todo.delete:
        try:
            if not remove(kube, namespace, obj):
                continue  # changed meanwhile: the next pass sees it again
        except ApiError as exc:
            if not refusals.refused(exc):
                raise
            done.refused.append(refusals.of(obj, "delete", exc))
            continue
        live.pop(key(obj), None)
        done.delete.append(obj)
    return live, done
