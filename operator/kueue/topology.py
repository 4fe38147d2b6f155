"""Kueue's topology-aware scheduling for a job's PodSets: its podset annotations, on a group's or
the syncer's pod template or on the job itself for every learner group, checked as Kueue's
jobframework checks them and turned into the PodSet's topologyRequest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.operator.render import naming as n

# Kueue's podset annotations for topology-aware scheduling (apis/kueue/*/topology_types.go) and
# the PodSetTopologyRequest field each becomes; the first three exclude each other.
REQUIRED, PREFERRED, UNCONSTRAINED = ("kueue.x-k8s.io/podset-required-topology",
                                      "kueue.x-k8s.io/podset-preferred-topology",
                                      "kueue.x-k8s.io/podset-unconstrained-topology")
SLICE_TOPOLOGY, SLICE_SIZE = "kueue.x-k8s.io/podset-slice-required-topology", "kueue.x-k8s.io/podset-slice-size"
GROUP_NAME = "kueue.x-k8s.io/podset-group-name"
ANNOTATIONS = (REQUIRED, PREFERRED, UNCONSTRAINED, SLICE_TOPOLOGY, SLICE_SIZE, GROUP_NAME)


def problems(where: str, annotations: Mapping[str, str]) -> list[str]:
    """Kueue's topology annotations that Kueue would refuse (its jobframework's rules)."""
    out = []
    given = [k for k in (REQUIRED, PREFERRED, UNCONSTRAINED) if k in annotations]
    if len(given) > 1:
        out.append(f"{where}[{given[1]}]: {given[0]} is set too; a PodSet takes one of required, preferred "
                   "and unconstrained topology")
    if UNCONSTRAINED in annotations and annotations[UNCONSTRAINED].lower() not in ("true", "false"):
        out.append(f"{where}[{UNCONSTRAINED}]: {annotations[UNCONSTRAINED]!r} is not true or false")
    if SLICE_SIZE in annotations and not (annotations[SLICE_SIZE].isdigit() and int(annotations[SLICE_SIZE]) > 0):
        out.append(f"{where}[{SLICE_SIZE}]: {annotations[SLICE_SIZE]!r} is not a positive integer")
    for key in (REQUIRED, PREFERRED, SLICE_TOPOLOGY):
        if key in annotations and not annotations[key]:
            out.append(f"{where}[{key}]: a topology level (a node label key) is required")
    return out


def request(annotations: Mapping[str, str], fallback: Mapping[str, str], *, gang_count: int | None,
                     hosts: int) -> dict[str, Any] | None:
    """A PodSet's topologyRequest from Kueue's annotations (the pod template's, else `fallback`:
    the job's), as Kueue's jobframework builds it; None when none asks for one. Pods are indexed
    by their StatefulSet ordinal; a multi-host group (`gang_count` learners of `hosts` pods) has
    one sub-group per learner, so a slice topology keeps each learner's hosts together."""
    source = annotations if any(k in annotations for k in ANNOTATIONS) else fallback
    out: dict[str, Any] = {}
    if REQUIRED in source:
        out["required"] = source[REQUIRED]
    elif PREFERRED in source:
        out["preferred"] = source[PREFERRED]
    elif UNCONSTRAINED in source:
        out["unconstrained"] = source[UNCONSTRAINED].lower() == "true"
    if SLICE_TOPOLOGY in source:
        out["podSetSliceRequiredTopology"] = source[SLICE_TOPOLOGY]
        size = source.get(SLICE_SIZE, "")
        out["podSetSliceSize"] = int(size) if size.isdigit() else hosts
    if not out:
        return None
    if GROUP_NAME in source and ("required" in out or "preferred" in out):
        out["podSetGroupName"] = source[GROUP_NAME]
    out["podIndexLabel"] = n.INDEX
    if gang_count is not None:
        out["subGroupIndexLabel"], out["subGroupCount"] = n.LEARNER_INDEX, gang_count
    return out
