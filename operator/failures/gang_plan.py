"""A multi-host learner's run and whole-gang restart, decided purely: operator/failures/gangs.py decides whether to
restart; this turns the decision into the status patch, the pods to delete and what is counted
and posted. operator/failures/restarts.py (the pod-event pass) and operator/reconcile/plan.py carry it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.contract import LearnerId
from diloco.operator.failures import gangs, pods
from diloco.operator.reconcile.actions import Count, Event
from diloco.operator.render import naming as n


@dataclass(frozen=True)
class Step:
    """What settling one multi-host learner does."""

    patch: dict[str, Any] = field(default_factory=dict)  # the status patch (empty: nothing changed)
    delete: list[dict[str, Any]] = field(default_factory=list)  # the surviving hosts of a restarted gang
    then: tuple[Event | Count, ...] = ()


def settle(status: dict[str, Any], *, namespace: str, job: str, learner: LearnerId, hosts: int,
           gang_pods: list[dict[str, Any]], now: float, gone: dict[str, Any] | None = None) -> Step:
    """Record the learner's run once all its hosts run, or restart it as a whole when one is
    lost. `gone`: a pod of it just deleted."""
    slot = str(learner)
    decision = gangs.decide(gang_pods, hosts, run=gangs.run_of(status, slot),
                            gang=n.gang(job, learner.group, learner.index), gone=gone)
    patch: dict[str, Any] = {}
    if decision.run is not None:
        patch.update(gangs.set_run(status, slot, decision.run))
    restart = decision.restart
    if restart is None:
        return Step(patch)
    current = {**status, **patch}
    counted = any(x.get("slot") == slot for x in pods.open_losses(current))
    lost_pod = gangs.by_host(gang_pods, hosts).get(restart.host) or gone or {}
    patch.update(gangs.record_restart(current, learner, restart=restart,
                                      lost_uid=lost_pod.get("metadata", {}).get("uid", ""), now=now))
    then: list[Event | Count] = []
    if not counted:
        then.append(Count("losses", (namespace, job, learner.group, restart.loss.reason)))
    then.append(Count("restarts", (namespace, job, learner.group)))
    then.append(Event("LearnerRestarting", f"{gangs.message(learner, restart)}; the other learners keep training",
                      warning=True))
    return Step(patch, list(restart.survivors), tuple(then))
