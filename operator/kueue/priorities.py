"""A Workload's priority, as Kueue's job integrations choose it: the job's
`kueue.x-k8s.io/priority-class` label names a WorkloadPriorityClass, else the first pod template's
priorityClassName a PriorityClass; its value (read by operator/kueue/api.py) goes into
spec.priority, the class named in the words of the Kueue version served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.operator.kube import KUEUE_GROUP
from diloco.spec import DecoupledDiLoCoJob

PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass, on the job (Kueue's label)
# v1beta1's spec.priorityClassSource values; v1beta2 names (group, kind) instead.
SOURCES = {"WorkloadPriorityClass": "kueue.x-k8s.io/workloadpriorityclass",
           "PriorityClass": "scheduling.k8s.io/priorityclass"}
GROUPS = {"WorkloadPriorityClass": KUEUE_GROUP, "PriorityClass": "scheduling.k8s.io"}


@dataclass(frozen=True)
class Priority:
    """The priority class a Workload names (`kind` WorkloadPriorityClass or PriorityClass) and its value."""

    kind: str
    name: str
    value: int


def priority_class(job: DecoupledDiLoCoJob) -> tuple[str, str] | None:
    """(kind, name) of the class whose value is the job's priority in Kueue, as Kueue's
    integrations choose it: the job's WorkloadPriorityClass label, else the first pod template's
    PriorityClass (the groups' in order, then the syncer's); None: Kueue's default."""
    if (name := (job.metadata.labels or {}).get(PRIORITY_LABEL)):
        return "WorkloadPriorityClass", name
    shapes = [(g.pod, g.template) for g in job.spec.learner_groups] + [(job.spec.syncer.pod, job.spec.syncer.template)]
    for pod, template in shapes:
        name = (template.spec.get("priorityClassName") if template is not None else None) or \
            (pod.priority_class_name if pod is not None else None)
        if name:
            return "PriorityClass", str(name)
    return None


def priority_fields(priority: Priority | None, version: str) -> dict[str, Any]:
    """The Workload spec's priority fields in `version`'s words."""
    if priority is None:
        return {}
    if version == "v1beta1":
        return {"priorityClassName": priority.name, "priorityClassSource": SOURCES[priority.kind],
                "priority": priority.value}
    return {"priorityClassRef": {"group": GROUPS[priority.kind], "kind": priority.kind, "name": priority.name},
            "priority": priority.value}
