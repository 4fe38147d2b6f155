"""What an admitted Workload puts into its job's pods, as Kueue's JobFramework takes it from the
admission: the assigned flavors' node labels and tolerations, Kueue's podset label, its topology
gate, the admission checks' podSetUpdates; and where that clashes with the pods' own template.
Pure: the ResourceFlavors come in read (operator/kueue/api.py, lookup_flavors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco.operator.kueue.integration import (
    POD_SET_LABEL,
    SYNCER_POD_SET,
    TOPOLOGY_GATE,
    WORKLOAD_ANNOTATION,
)
from diloco.operator.kueue.topology import UNCONSTRAINED
from diloco.operator.render import naming as n


@dataclass(frozen=True)
class PodSetInfo:
    """What an admitted PodSet's pods get (Kueue's podset.PodSetInfo): merged into its pod template."""

    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    scheduling_gates: list[str] = field(default_factory=list)


def flavor_names(wl: Mapping[str, Any] | None) -> list[str]:
    """The ResourceFlavors Kueue assigned the Workload's PodSets."""
    admission = ((wl or {}).get("status") or {}).get("admission") or {}
    return sorted({str(f) for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()})


def _merge(into: dict[str, str], more: Mapping[str, str] | None, what: str, problems: list[str]) -> None:
    for k, v in (more or {}).items():
        if k in into and into[k] != v:
            problems.append(f"{what} {k}={v!r} clashes with {into[k]!r}")
        else:
            into[k] = v


def _add(into: list[Any], more: Any) -> None:
    into.extend(x for x in more or [] if x not in into)


def placement(wl: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any] | None],
              ) -> tuple[dict[str, PodSetInfo], list[str]]:
    """What each PodSet of the admitted Workload `wl` puts into its pods, by PodSet name, as
    Kueue's JobFramework takes it from the admission (getPodSetsInfoFromStatus): the assigned
    flavors' nodeLabels and tolerations (`flavors`: each ResourceFlavor by name, None if gone),
    Kueue's podset label, with a topology assignment its scheduling gate and the Workload's
    name, then each admission check's podSetUpdates; and what prevents it (a missing flavor, an
    update that contradicts the rest). A flavor not in `flavors` at all is skipped."""
    status = wl.get("status") or {}
    requests = {p.get("name"): p.get("topologyRequest") or {} for p in (wl.get("spec") or {}).get("podSets") or []}
    out: dict[str, PodSetInfo] = {}
    problems: list[str] = []
    for assignment in (status.get("admission") or {}).get("podSetAssignments") or []:
        name = str(assignment.get("name"))
        info = PodSetInfo(labels={POD_SET_LABEL: name})
        found: list[str] = []
        for flavor in dict.fromkeys((assignment.get("flavors") or {}).values()):
            if flavor not in flavors:
                continue  # not looked up (unreadable): its caller says why
            obj = flavors[flavor]
            if obj is None:
                found.append(f"ResourceFlavor {flavor} not found")
                continue
            info.node_selector.update((obj.get("spec") or {}).get("nodeLabels") or {})
            _add(info.tolerations, (obj.get("spec") or {}).get("tolerations"))
        if assignment.get("topologyAssignment") is not None:
            if not {"required", "preferred", "unconstrained"} & set(requests.get(name) or {}):
                info.annotations[UNCONSTRAINED] = "true"
            info.annotations[WORKLOAD_ANNOTATION] = str(wl.get("metadata", {}).get("name", ""))
            info.scheduling_gates.append(TOPOLOGY_GATE)
        for check in status.get("admissionChecks") or []:
            for update in check.get("podSetUpdates") or []:
                if update.get("name") != name:
                    continue
                where = f"admission check {check.get('name')}:"
                _merge(info.labels, update.get("labels"), f"{where} label", found)
                _merge(info.annotations, update.get("annotations"), f"{where} annotation", found)
                _merge(info.node_selector, update.get("nodeSelector"), f"{where} nodeSelector", found)
                _add(info.tolerations, update.get("tolerations"))
        problems += [f"PodSet {name}: {p}" for p in found]
        out[name] = info
    return out, problems


def clashes(infos: Mapping[str, PodSetInfo], pod_sets_: list[dict[str, Any]]) -> list[str]:
    """Where the admission contradicts a PodSet's own pod template (a node label or pod label it
    sets otherwise): Kueue refuses to start such a job, and so does the operator."""
    out = []
    for pod_set in pod_sets_:
        info = infos.get(pod_set["name"])
        if info is None:
            continue
        template = pod_set.get("template") or {}
        for what, ours, theirs in (
                ("nodeSelector", (template.get("spec") or {}).get("nodeSelector") or {}, info.node_selector),
                ("label", (template.get("metadata") or {}).get("labels") or {}, info.labels)):
            for k, v in sorted(theirs.items()):
                if k in ours and ours[k] != v:
                    out.append(f"PodSet {pod_set['name']}: the admission's {what} {k}={v!r} clashes with the pods' "
                               f"{ours[k]!r}")
    return out


def pod_set_of(template: Mapping[str, Any]) -> str | None:
    """The PodSet a rendered pod template belongs to: its learner group's, or the syncer's."""
    labels = (template.get("metadata") or {}).get("labels") or {}
    if labels.get(n.COMPONENT) == n.LEARNER:
        return labels.get(n.GROUP)
    return SYNCER_POD_SET if labels.get(n.COMPONENT) == n.SYNCER else None


def place(objs: list[dict[str, Any]], infos: Mapping[str, PodSetInfo]) -> list[dict[str, Any]]:
    """The rendered children with each admitted PodSet's info merged into its workloads' pod
    templates (Kueue's podset.Merge: maps added, tolerations and gates appended once)."""
    if not infos:
        return objs
    out = []
    for obj in objs:
        template = (obj.get("spec") or {}).get("template") if obj["kind"] in ("StatefulSet", "Deployment") else None
        info = infos.get(pod_set_of(template) or "") if template else None
        if template is None or info is None:
            out.append(obj)
            continue
        tm, ts = dict(template.get("metadata") or {}), dict(template["spec"])
        tm["labels"] = {**(tm.get("labels") or {}), **info.labels}
        if info.annotations:
            tm["annotations"] = {**(tm.get("annotations") or {}), **info.annotations}
        if info.node_selector:
            ts["nodeSelector"] = {**(ts.get("nodeSelector") or {}), **info.node_selector}
        if info.tolerations:
            tolerations = list(ts.get("tolerations") or [])
            _add(tolerations, info.tolerations)
            ts["tolerations"] = tolerations
        if info.scheduling_gates:
            gates = list(ts.get("schedulingGates") or [])
            _add(gates, [{"name": g} for g in info.scheduling_gates])
            ts["schedulingGates"] = gates
        out.append({**obj, "spec": {**obj["spec"], "template": {**template, "metadata": tm, "spec": ts}}})
    return out
