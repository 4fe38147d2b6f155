"""Re-admission, decided in one place: a lost learner slot is back once its pods say so.

Three passes ask, and all take this answer: the pod-event pass (operator/reconcile/passes.py) on a
learner pod's event, and the reconcile's plan (operator/reconcile/plan.py) for a one-host learner
whose ready pod's event was missed or came out of order, and for every multi-host learner. A
one-host learner is back once its pod is ready; a multi-host learner once every host of its
recorded run is intact and ready (operator/failures/gangs.py: `back`). A slot not lost
(operator/failures/pods.py: `lostLearners`) is not re-admitted, so duplicate or re-ordered
events count one re-admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.contract import LearnerId
from diloco.operator.failures import gangs, pods
from diloco.operator.reconcile.actions import Count, Event


@dataclass(frozen=True)
class Readmitted:
    """A lost slot re-admitted: the status patch, and what is counted and posted."""

    patch: dict[str, Any]  # lostLearners without the slot, its group's readmitted counter (lists: replaced whole)
    count: Count
    event: Event

    @property
    def then(self) -> tuple[Count, Event]:
        return self.count, self.event


def decide(status: dict[str, Any], ref: dict[str, Any], learner: LearnerId, slot_pods: list[dict[str, Any]], *,
           hosts: int = 1) -> Readmitted | None:
    """Whether `learner`'s slot is re-admitted now, its pods as `slot_pods` shows them: a one-host
    learner's pod (`hosts` 1) once it is ready, a multi-host learner's gang (`hosts` > 1) once all
    its hosts are back; None when the slot is not lost or not back. `ref`: the job, for the count's
    labels."""
    if hosts > 1:
        back = gangs.back(slot_pods, hosts, gangs.run_of(status, str(learner)))
        why = f"all {hosts} hosts are ready"
    else:
        ready = next((p for p in slot_pods if pods.ready(p)), None)
        back, why = ready is not None, f"pod {ready['metadata']['name']} is ready" if ready is not None else ""
    patch = pods.record_ready(status, learner) if back else None
    if patch is None:
        return None
    meta = ref["metadata"]
    return Readmitted(patch, Count("readmissions", (meta["namespace"], meta["name"], learner.group)),
                      Event("LearnerReadmitted", f"learner {learner} is back: {why}"))
