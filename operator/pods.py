"""Pure pod bookkeeping: when a learner is lost (and why), when it is back, when a pod is stuck.

A learner *slot* (`group-index`) is either up or lost. The first sign of trouble for a slot
that is up counts one loss; further signs for the same slot (the Terminating update, then
the DELETED event, a replacement that crashes before it is ready) do not, until a ready pod
re-admits the slot. The open losses live in `status.lostLearners`, so counting survives
operator restarts and duplicate or re-ordered watch events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.contract import LearnerId
from diloco.operator import status as st

# Pod disruption reasons (the DisruptionTarget condition, Kubernetes 1.26+) -> our reasons.
DISRUPTIONS = {
    "PreemptionByScheduler": "Preempted",
    "PreemptionByKubeScheduler": "Preempted",
    "EvictionByEvictionAPI": "Evicted",
    "TerminationByKubelet": "Evicted",  # node-pressure eviction or node shutdown
    "DeletionByTaintManager": "Evicted",
    "DeletionByPodGC": "Deleted",
}
PREEMPTED = "Preempted"


@dataclass(frozen=True)
class Loss:
    reason: str  # Deleted, Evicted, Preempted or Failed
    detail: str


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
            return Loss(DISRUPTIONS.get(why, "Deleted"), f"pod {name}: {why or 'disrupted'}")
        return Loss("Deleted", f"pod {name} deleted")
    if s.get("phase") == "Failed":
        why = s.get("reason") or "Failed"
        return Loss("Evicted" if why == "Evicted" else "Failed", f"pod {name} failed: {why}")
    for cs in s.get("containerStatuses") or []:
        last = (cs.get("lastState") or {}).get("terminated")
        if cs.get("restartCount", 0) > 0 and not cs.get("ready") and last:
            return Loss("Failed", f"pod {name}: container {cs.get('name')} exited with code "
                                  f"{last.get('exitCode')} ({last.get('reason', 'Error')})")
    return None


def open_losses(status: dict[str, Any]) -> list[dict[str, Any]]:
    return list(status.get("lostLearners") or [])


def record_loss(status: dict[str, Any], learner: LearnerId, lost: Loss, pod_uid: str,
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
    counter = "preempted" if lost.reason == PREEMPTED else "lost"
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
