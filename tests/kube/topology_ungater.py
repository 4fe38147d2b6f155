"""Kueue's TopologyUngater (pkg/controller/tas/topology_ungater.go) for tests, over the API.

For an admitted Workload whose PodSet assignments carry a topologyAssignment, it finds each
PodSet's pods as Kueue does (the `kueue.x-k8s.io/podset` label with the PodSet's name, in the
Workload's namespace, and the `kueue.x-k8s.io/workload` annotation naming the Workload), ranks
them by the PodSet's podIndexLabel, gives the pod of rank r the r-th slot of the assignment's
domains (each domain `count` slots, in order), copies that domain's node labels (the
assignment's `levels` with the domain's `values`) into the pod's nodeSelector and removes the
`kueue.x-k8s.io/topology` scheduling gate. A pod it cannot find that way stays gated, as with
Kueue. The assignment is read in v1beta1's form (levels, domains of values and count).
"""

from __future__ import annotations

from typing import Any

from diloco.operator.kube import Kube
from diloco.operator.kueue import integration as kueue


def _rank(pod: dict[str, Any], label: str | None) -> int:
    value = (pod["metadata"].get("labels") or {}).get(label or "", "")
    return int(value) if value.isdigit() else 1 << 30


def ungate(api: Kube, wl: dict[str, Any]) -> list[str]:
    """Ungate the Workload's topology-assigned pods; the names of those ungated now."""
    namespace, name = wl["metadata"]["namespace"], wl["metadata"]["name"]
    requests = {p["name"]: p.get("topologyRequest") or {} for p in wl["spec"]["podSets"]}
    done = []
    for assignment in ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
        topology = assignment.get("topologyAssignment")
        if not topology:
            continue
        levels = topology["levels"]
        slots = [d["values"] for d in topology["domains"] for _ in range(int(d["count"]))]
        pods = [p for p in api.list("Pod", namespace)
                if (p["metadata"].get("labels") or {}).get(kueue.POD_SET_LABEL) == assignment["name"]
                and (p["metadata"].get("annotations") or {}).get(kueue.WORKLOAD_ANNOTATION) == name
                and not p["metadata"].get("deletionTimestamp")]
        pods.sort(key=lambda p: _rank(p, requests.get(assignment["name"], {}).get("podIndexLabel")))
        for rank, pod in enumerate(pods[:len(slots)]):
            gates = pod["spec"].get("schedulingGates") or []
            if not any(g["name"] == kueue.TOPOLOGY_GATE for g in gates):
                continue
            selector = {**(pod["spec"].get("nodeSelector") or {}), **dict(zip(levels, slots[rank], strict=True))}
            api.patch("Pod", namespace, pod["metadata"]["name"], {"spec": {
                "schedulingGates": [g for g in gates if g["name"] != kueue.TOPOLOGY_GATE] or None,
                "nodeSelector": selector}})
            done.append(pod["metadata"]["name"])
    return done
