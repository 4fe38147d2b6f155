"""Pure: pods waiting for capacity. Waiting is not failing.

A pod the scheduler cannot place (`PodScheduled=False`, reason `Unschedulable`) is queued for
capacity: a cluster autoscaler, a node pool being provisioned, a TPU slice freed by another job
or a reservation starting later all end the wait without anything being wrong with the job. So,
as in JobSet and Kubeflow Trainer, it never counts against spec.runPolicy.backoffLimit: the job
stays in its phase (Pending until learners run) with condition PodsUnschedulable saying which
pod waits, since when and the scheduler's own message. Only an explicit limit ends the wait:
spec.runPolicy.schedulingTimeoutSeconds (Failed/SchedulingTimeoutExceeded), or
activeDeadlineSeconds, which counts from the start, waiting included (Failed/DeadlineExceeded).
Preempted and evicted pods are losses (operator/failures/pods.py), not this.

A pod held back by a scheduling gate (`PodScheduled=False`, reason `SchedulingGated`) waits for
whoever put the gate there: Kueue's TopologyUngater and ElasticJobUngater lift theirs within
seconds of an admission. One still gated after GATE_GRACE is a gate nobody is lifting (no
topology assignment, a label Kueue does not find the pod by), and it shows the same way, the
condition and its Event naming the gate and what lifts it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diloco.operator.failures import policy as failures
from diloco.operator.status import conditions as c

TIMED_OUT = "SchedulingTimeoutExceeded"  # the Failed condition's reason
WAITING, SCHEDULED = "Unschedulable", "PodsScheduled"  # PodsUnschedulable's reasons (True, False)
GATED = "SchedulingGated"  # the kube-scheduler's PodScheduled reason for a pod with schedulingGates
# Seconds a pod may stay gated before the job shows it: Kueue's ungaters act within seconds.
GATE_GRACE = 60.0
# Who lifts the gates Kueue puts on an admitted job's pods, for the message.
LIFTED_BY = {"kueue.x-k8s.io/topology": "Kueue's TopologyUngater lifts it once the Workload's topology assignment "
                                        "is applied (check status.admission.podSetAssignments[].topologyAssignment "
                                        "and the pod's kueue.x-k8s.io/podset label and kueue.x-k8s.io/workload "
                                        "annotation)",
             "kueue.x-k8s.io/elastic-job": "Kueue's ElasticJobUngater lifts it once the Workload slice is admitted"}
GATE_FIX = "the scheduler places the pod once no gate is left on it"
FIX = ("no node fits the pod now: compare its nodeSelector, tolerations and resources with the cluster's nodes "
       "(kubectl describe pod), or add capacity; the job starts when a node fits")


@dataclass(frozen=True)
class Waiting:
    """One pod the scheduler could not place, since `since` (Unix seconds)."""

    pod: str
    who: str  # "learner us-1", "syncer"
    since: float
    message: str  # the scheduler's, e.g. "0/3 nodes are available: 3 Insufficient google.com/tpu."
    gated: bool = False  # held back by a scheduling gate, not by a lack of nodes

    def seconds(self, now: float) -> float:
        return max(0.0, now - self.since)


def _time(value: str | None) -> float | None:
    if not value:
        return None
    parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()


def waiting(pods: Iterable[dict[str, Any]], now: float, gate_grace: float = GATE_GRACE) -> list[Waiting]:
    """The pods the scheduler marked Unschedulable, and those gated past `gate_grace`, longest
    waiting first (pods being deleted are going anyway and do not count)."""
    out = []
    for pod in pods:
        meta, s = pod.get("metadata", {}), pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        sched = next((x for x in s.get("conditions") or [] if x.get("type") == "PodScheduled"), None)
        if not sched or sched.get("status") != "False" or sched.get("reason") not in ("Unschedulable", GATED):
            continue
        since = _time(sched.get("lastTransitionTime")) or _time(meta.get("creationTimestamp")) or now
        message = sched.get("message") or "no node fits"
        if sched.get("reason") == GATED:
            if now - since < gate_grace:
                continue
            message = gated(pod)
        out.append(Waiting(meta.get("name", "?"), failures.who(pod), since, message, sched.get("reason") == GATED))
    return sorted(out, key=lambda w: (w.since, w.pod))


def gated(pod: dict[str, Any]) -> str:
    """What holds a gated pod back: each gate by name, and what lifts it."""
    gates = [str(g.get("name")) for g in (pod.get("spec") or {}).get("schedulingGates") or []]
    said = [f"scheduling gate {g}" + (f" ({LIFTED_BY[g]})" if g in LIFTED_BY else " (whoever added it must remove it)")
            for g in gates] or ["a scheduling gate"]
    return f"held back by {'; '.join(said)}"


def _limit(timeout: int | None) -> str:
    if timeout is None:
        return "spec.runPolicy.schedulingTimeoutSeconds is unset, so the job waits for capacity"
    return f"the job fails after spec.runPolicy.schedulingTimeoutSeconds={timeout}"


def timed_out(pods: list[Waiting], timeout: int | None, now: float) -> str | None:
    """The Failed ending's message once a pod waited past schedulingTimeoutSeconds, else None."""
    if timeout is None or not pods or pods[0].seconds(now) < timeout:
        return None
    w = pods[0]
    return (f"pod {w.pod} ({w.who}) could not be scheduled for {w.seconds(now):.0f} s, past "
            f"spec.runPolicy.schedulingTimeoutSeconds={timeout}: {w.message}")


def message(pods: list[Waiting], timeout: int | None) -> str:
    w = pods[0]
    others = f" (and {len(pods) - 1} more pods)" if len(pods) > 1 else ""
    since = dt.datetime.fromtimestamp(w.since, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    # A time, not a duration: the message stays the same from pass to pass (no status write each time).
    if w.gated:
        return (f"pod {w.pod} ({w.who}) is waiting, gated since {since}: {w.message}{others}; {GATE_FIX}. "
                f"Waiting is not a failure: {_limit(timeout)}")
    return (f"pod {w.pod} ({w.who}) is waiting for capacity, unschedulable since {since}: "
            f"{w.message}{others}; {FIX}. Waiting is not a failure: {_limit(timeout)}")


def condition(conds: list[c.Condition], pods: list[Waiting], *, timeout: int | None, stamp: str,
              generation: int) -> list[c.Condition]:
    """PodsUnschedulable: True while a pod waits for capacity; absent on jobs that never waited."""
    if pods:
        return c.set_condition(conds, c.PODS_UNSCHEDULABLE, True, reason=WAITING,
                               message=message(pods, timeout), now=stamp, generation=generation)
    if c.find(conds, c.PODS_UNSCHEDULABLE) is None:
        return conds
    return c.set_condition(conds, c.PODS_UNSCHEDULABLE, False, reason=SCHEDULED,
                           message="every pod has been scheduled", now=stamp, generation=generation)


def _longest(cond: c.Condition | None) -> str | None:
    """The pod a True PodsUnschedulable names first (the longest waiting), as `message` wrote it."""
    if cond is None or cond.get("status") != "True":
        return None
    return str(cond.get("message", "")).split(" is waiting", 1)[0]


def started_waiting(old: list[c.Condition], new: list[c.Condition]) -> c.Condition | None:
    """The new PodsUnschedulable condition when its Warning Event is due: it just became True, or
    the pod it names first changed (the one named before was placed: a syncer waits a moment
    for its volume, the learners for a node pool), so each wait is told once."""
    now = c.find(new, c.PODS_UNSCHEDULABLE)
    first = _longest(now)
    if first is None or first == _longest(c.find(old, c.PODS_UNSCHEDULABLE)):
        return None
    return now
