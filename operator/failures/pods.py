"""Pure pod bookkeeping: when a learner is lost (and why), when it is back, when a pod is stuck.

A learner *slot* (`group-index`) is either up or lost. The first sign of trouble for a slot
that is up counts one loss (or one planned restart, when chaos or a rollout caused it); further signs for the same slot (the Terminating update, then
the DELETED event, a replacement that crashes before it is ready) do not, until a ready pod
re-admits the slot. The open losses live in `status.lostLearners`, so counting survives
operator restarts and duplicate or re-ordered watch events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.contract import LearnerId
from diloco.operator.render.naming import CHAOS as CHAOS_ANNOTATION
from diloco.operator.status import job as st

# Pod disruption reasons (the DisruptionTarget condition, Kubernetes 1.26+) -> our reasons. A
# preemption is the capacity taken back: the scheduler's, a spot or preemptible node reclaimed
# (the node goes: its pods are deleted by the taint manager) or shut down gracefully (the kubelet
# terminates them; node-pressure evictions, by the same kubelet, say Evicted in the pod's reason).
DISRUPTIONS = {
    "PreemptionByScheduler": "Preempted",
    "PreemptionByKubeScheduler": "Preempted",
    "EvictionByEvictionAPI": "Evicted",
    "TerminationByKubelet": "Preempted",
    "DeletionByTaintManager": "Preempted",
    "DeletionByPodGC": "Deleted",
}
# A pod's status.reason when the kubelet ended it for a node shutdown (before DisruptionTarget).
NODE_SHUTDOWN = {"Terminated", "Shutdown", "NodeShutdown"}
PREEMPTED = "Preempted"
CHAOS, ROLLOUT = "Chaos", "Rollout"  # planned restarts: ours, not the cluster's
REVISION = "controller-revision-hash"  # a StatefulSet pod's template revision


@dataclass(frozen=True)
class Loss:
    reason: str  # Deleted, Evicted, Preempted, Failed; Chaos or Rollout when planned
    detail: str
    planned: bool = False  # a restart we caused (chaos, a template rollout): not a learner loss


def _condition(pod: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((x for x in (pod.get("status") or {}).get("conditions") or [] if x.get("type") == type_), None)


def terminating(pod: dict[str, Any]) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def ready(pod: dict[str, Any]) -> bool:
    s = pod.get("status") or {}
    cond = _condition(pod, "Ready")
    return (not terminating(pod) and s.get("phase") == "Running" and cond is not None
            and cond.get("status") == "True")


def loss(event_type: str | None, pod: dict[str, Any]) -> Loss | None:
    """Whether this watch event shows the pod's learner gone, and why; None if it is fine."""
    s = pod.get("status") or {}
    name = pod.get("metadata", {}).get("name", "?")
    if event_type == "DELETED" or terminating(pod):
        disruption = _condition(pod, "DisruptionTarget")
        if disruption and disruption.get("status") == "True":
            why = disruption.get("reason", "")
            reason = "Evicted" if s.get("reason") == "Evicted" else DISRUPTIONS.get(why, "Deleted")
            return Loss(reason, f"pod {name}: {why or 'disrupted'}")
        return Loss("Deleted", f"pod {name} deleted")
    if s.get("phase") == "Failed":
        why = s.get("reason") or "Failed"
        reason = "Evicted" if why == "Evicted" else PREEMPTED if why in NODE_SHUTDOWN else "Failed"
        return Loss(reason, f"pod {name} failed: {why}")
    for cs in s.get("containerStatuses") or []:
        last = (cs.get("lastState") or {}).get("terminated")
        if cs.get("restartCount", 0) > 0 and not cs.get("ready") and last:
            return Loss("Failed", f"pod {name}: container {cs.get('name')} exited with code "
                                  f"{last.get('exitCode')} ({last.get('reason', 'Error')})")
    return None


def planned(lost: Loss, pod: dict[str, Any], update_revision: str | None) -> Loss:
    """The loss as a planned restart when we caused it: chaos killed the pod, or its StatefulSet
    replaced it for a newer template (`update_revision`: the StatefulSet's status.updateRevision)."""
    meta = pod.get("metadata") or {}
    if (meta.get("annotations") or {}).get(CHAOS_ANNOTATION):
        return Loss(CHAOS, f"{lost.detail} by chaos", planned=True)
    revision = (meta.get("labels") or {}).get(REVISION)
    if lost.reason == "Deleted" and update_revision and revision and revision != update_revision:
        return Loss(ROLLOUT, f"{lost.detail} for the new template ({update_revision})", planned=True)
    return lost


def open_losses(status: dict[str, Any]) -> list[dict[str, Any]]:
    return list(status.get("lostLearners") or [])


def record_loss(status: dict[str, Any], learner: LearnerId, *, lost: Loss, pod_uid: str,
                now: float) -> dict[str, Any] | None:
    """The status patch that counts this loss, or None when the slot is already lost."""
    slot, group = str(learner), learner.group
    losses = open_losses(status)
    if any(x.get("slot") == slot for x in losses):
        return None
    groups = [dict(g) for g in status.get("learnerGroups") or []]
    entry = next((g for g in groups if g.get("name") == group), None)
    if entry is None:
        entry = st.group_entry(status, group)
        groups.append(entry)
    counter = "planned" if lost.planned else "preempted" if lost.reason == PREEMPTED else "lost"
    entry[counter] = entry.get(counter, 0) + 1
    losses.append({"slot": slot, "reason": lost.reason, "pod": pod_uid, "since": st.rfc3339(now)})
    return {"learnerGroups": groups, "lostLearners": losses}  # lists: a merge patch replaces them whole


def record_ready(status: dict[str, Any], learner: LearnerId) -> dict[str, Any] | None:
    """The status patch that re-admits a lost slot whose pod is ready again, or None."""
    slot, group = str(learner), learner.group
    losses = open_losses(status)
    if not any(x.get("slot") == slot for x in losses):
        return None
    groups = [dict(g) for g in status.get("learnerGroups") or []]
    for entry in groups:
        if entry.get("name") == group:
            entry["readmitted"] = entry.get("readmitted", 0) + 1
    return {"learnerGroups": groups, "lostLearners": [x for x in losses if x.get("slot") != slot]}


def stuck(pods: list[dict[str, Any]], now: float, timeout: float) -> list[dict[str, Any]]:
    """Pods still Terminating `timeout` seconds past their grace period (typically a lost node)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata", {})
        since = st.parse_time(meta.get("deletionTimestamp"))
        if since is not None and now - since > timeout:
            out.append(pod)
    return out


def restarts(pods: list[dict[str, Any]]) -> int:
    """Container restarts summed over pods (the syncer's count feeds the backoff limit)."""
    return sum(cs.get("restartCount", 0) for p in pods for cs in (p.get("status") or {}).get("containerStatuses") or [])
