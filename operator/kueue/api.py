"""Kueue's reads and writes: the cluster-scoped objects a queued job's pass reads (the
ResourceFlavors an admission names, the job's priority class) and the Workload status writes
(operator/kueue/lifecycle.py decides them), each guarded by the Workload's resourceVersion.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.operator.kube import ApiError, Kube
from diloco.operator.kueue import lifecycle
from diloco.operator.kueue.integration import FINALIZER, KIND
from diloco.operator.kueue.placement import flavor_names
from diloco.operator.kueue.priorities import PRIORITY_LABEL, Priority, priority_class
from diloco.spec import DecoupledDiLoCoJob


def lookup_flavors(kube: Kube, wl: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any] | None], list[str]]:
    """The ResourceFlavors the admission names (cluster-scoped), None for one that is gone; and
    those the operator may not read (its RBAC: the chart's <release>-kueue ClusterRole)."""
    found: dict[str, dict[str, Any] | None] = {}
    refused = []
    for name in flavor_names(wl):
        try:
            found[name] = kube.get("ResourceFlavor", None, name)
        except ApiError as exc:
            if exc.status != 403:
                raise
            refused.append(f"ResourceFlavor {name} cannot be read: {exc.detail}")
    return found, refused


def lookup_priority(kube: Kube, job: DecoupledDiLoCoJob) -> tuple[Priority | None, str]:
    """The job's priority class and its value; or why it has none ("" when it names no class)."""
    found = priority_class(job)
    if found is None:
        return None, ""
    kind, name = found
    try:
        obj = kube.get(kind, None, name)
    except ApiError as exc:
        if exc.status != 403:
            raise
        return None, f"{kind} {name} cannot be read: {exc.detail}"
    if obj is None:
        where = f"the job's {PRIORITY_LABEL} label" if kind == "WorkloadPriorityClass" else "a pod template"
        return None, f"{kind} {name} (named by {where}) not found"
    return Priority(kind, name, int(obj.get("value") or 0)), ""


def write(kube: Kube, wl: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Write `status` on the Workload, guarded by its resourceVersion; False on a conflict or when
    it is gone (the next pass reads it again)."""
    md = wl["metadata"]
    try:
        kube.patch(KIND, md["namespace"], md["name"],
                   {"metadata": {"resourceVersion": md.get("resourceVersion")}, "status": dict(status)}, sub="status")
    except ApiError as exc:
        if exc.status not in (404, 409):
            raise
        return False
    return True


def finish(kube: Kube, live: Mapping[str, Any], *, succeeded: bool, message: str, now: str) -> None:
    """Mark a finished job's Workload Finished (Kueue then frees its quota); lifecycle.finish
    decides the status, written as `write` writes it."""
    status = lifecycle.finish(live, succeeded=succeeded, message=message, now=now)
    if status is not None:
        write(kube, live, status)



def let_go(kube: Kube, wl: Mapping[str, Any]) -> bool:
    """Take the integration's finalizer (FINALIZER) off a Workload, guarded by its
    resourceVersion (other finalizers stay); False on a conflict or when it is gone."""
    md = wl["metadata"]
    finalizers = list(md.get("finalizers") or [])
    try:
        kube.patch(KIND, md["namespace"], md["name"], {"metadata": {
            "resourceVersion": md.get("resourceVersion"), "finalizers": [f for f in finalizers if f != FINALIZER]}})
    except ApiError as exc:
        if exc.status not in (404, 409):
            raise
        return False
    return True
