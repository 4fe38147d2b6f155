"""What Kueue leaves to a job's integration once it has decided: the Workload status writes.

Kueue's scheduler reserves quota and its controllers evict; everything after that is the job
integration's (Kueue's jobframework reconciler, pkg/controller/jobframework/reconciler.go, does it
for Kueue's built-in kinds; for this CRD the operator is the integration):

- eviction (preempted, deactivated, a waitForPodsReady timeout, ...): the job is stopped
  (kueue.gate suspends it), and once none of its pods is left the reservation is released:
  `Requeued` set (True where Kueue requeues on its own: Preempted, NodeFailures), `QuotaReserved`
  False with reason PendingEvaluation, the admission cleared and `Admitted` False
  (NoReservation). Kueue then frees the quota, admits whoever was waiting, and queues this
  Workload again; until the integration does this, the evicted job keeps its quota forever.
- `PodsReady`: True (Started, or Recovered after a pod was lost) once every admitted pod is
  Ready, False (WaitForStart, or WaitForRecovery once it had been True) otherwise, and
  False/WaitForStart whenever the Workload is not admitted (an evicted one once its quota is
  given back), as generatePodsReadyCondition writes it, evicted or not. Kueue reads it only with `waitForPodsReady` on, and
  evicts a job whose pods are not Ready in time; the operator cannot read Kueue's
  configuration, so it writes it always (harmless otherwise, and it shows in `kubectl describe`).
- `Finished` when the job ends (its quota goes back at once).

Each write replaces the condition list whole, guarded by the Workload's resourceVersion (the other
conditions are Kueue's); a conflict waits for the next pass. Pure: operator/kueue/api.py writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.operator.failures import pods as p
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue.placement import pod_set_of
from diloco.operator.render import naming as n
from diloco.operator.status import conditions as c

REQUEUED, PODS_READY = "Requeued", "PodsReady"
# Kueue's eviction reasons after which it queues the Workload again by itself (Requeued True);
# after any other (Deactivated, PodsReadyTimeout, ...) its own rules decide.
REQUEUED_BY_KUEUE = frozenset({"Preempted", "NodeFailures"})
PENDING = "PendingEvaluation"  # QuotaReserved's reason for a Workload back in its queue
NOT_READY = "Not all pods are ready or succeeded"  # Kueue's messages, word for word
RECOVERING = "At least one pod has failed, waiting for recovery"
READY = "All pods reached readiness and the workload is running"


def _conds(wl: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((wl.get("status") or {}).get("conditions") or [])


def _generation(wl: Mapping[str, Any]) -> int:
    return int((wl.get("metadata") or {}).get("generation") or 0)


def evicted_reason(wl: Mapping[str, Any]) -> tuple[str, str]:
    cond = c.find(_conds(wl), kueue.EVICTED) or {}
    return str(cond.get("reason") or "Evicted"), str(cond.get("message") or "")


def release(wl: Mapping[str, Any], now: str) -> dict[str, Any] | None:
    """The status that gives an evicted Workload's quota back (UnsetQuotaReservationWithCondition
    and SetRequeuedCondition); None when it holds none (any more) or is not evicted."""
    if not kueue.evicted(wl) or not kueue.holds_quota(wl):
        return None
    reason, message = evicted_reason(wl)
    gen = _generation(wl)
    conds = c.set_condition(_conds(wl), REQUEUED, reason in REQUEUED_BY_KUEUE, reason=reason, message=message,
                            now=now, generation=gen)
    conds = c.set_condition(conds, kueue.QUOTA_RESERVED, False, reason=PENDING, message=message, now=now,
                            generation=gen)
    conds = c.set_condition(conds, kueue.ADMITTED, False, reason="NoReservation",
                            message="The workload has no reservation", now=now, generation=gen)
    return {"conditions": conds, "admission": None}


def pods_ready(wl: Mapping[str, Any], ready: bool, now: str) -> dict[str, Any] | None:
    """The status with the PodsReady condition Kueue's jobframework would write now; None when the
    one there already says it (type, status and reason)."""
    old = c.find(_conds(wl), PODS_READY)
    if not kueue.admitted(wl):
        status, reason, message = False, "WaitForStart", NOT_READY
    elif ready:
        recovering = old is not None and old.get("reason") in ("WaitForRecovery", "Recovered")
        status, reason, message = True, "Recovered" if recovering else "Started", READY
    elif old is not None and (old.get("status") == "True" or old.get("reason") == "WaitForRecovery"):
        status, reason, message = False, "WaitForRecovery", RECOVERING
    else:
        status, reason, message = False, "WaitForStart", NOT_READY
    if old is not None and old.get("status") == ("True" if status else "False") and old.get("reason") == reason:
        return None
    return {"conditions": c.set_condition(_conds(wl), PODS_READY, status, reason=reason, message=message, now=now,
                                          generation=_generation(wl))}


def pod_set(pod: Mapping[str, Any]) -> str | None:
    """The PodSet a pod of the job counts for: its learner group's, or the syncer's."""
    return pod_set_of({"metadata": pod.get("metadata") or {}})


def all_ready(admitted: Mapping[str, int], job_pods: list[dict[str, Any]]) -> bool:
    """Every PodSet has as many Ready pods as Kueue admitted for it (job.PodsReady)."""
    ready: dict[str, int] = {}
    for pod in job_pods:
        if (name := pod_set(pod)) is not None and p.ready(pod) and not pod["metadata"].get("deletionTimestamp"):
            ready[name] = ready.get(name, 0) + 1
    return all(ready.get(name, 0) >= count for name, count in admitted.items())


def stopped(job_pods: list[dict[str, Any]]) -> bool:
    """None of the job's pods is left (Terminating ones still hold their node): job.IsActive false."""
    return not any((pod.get("metadata") or {}).get("labels", {}).get(n.COMPONENT) in (n.LEARNER, n.SYNCER)
                   for pod in job_pods)


def finish(wl: Mapping[str, Any], *, succeeded: bool, message: str, now: str) -> dict[str, Any] | None:
    """The status marking a finished job's Workload Finished (Kueue then frees its quota); None
    when it already is. The other conditions are Kueue's: the list is written whole."""
    if kueue.finished(wl):
        return None
    conds = c.set_condition(_conds(wl), kueue.FINISHED, True, reason="Succeeded" if succeeded else "Failed",
                            message=message, now=now, generation=_generation(wl))
    return {"conditions": conds}
