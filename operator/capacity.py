"""Pure: pods waiting for capacity. Waiting is not failing.

A pod the scheduler cannot place (`PodScheduled=False`, reason `Unschedulable`) is queued for
capacity: a cluster autoscaler, a node pool being provisioned, a TPU slice freed by another job
or a reservation starting later all end the wait without anything being wrong with the job. So,
as in JobSet and Kubeflow Trainer, it never counts against spec.runPolicy.backoffLimit: the job
stays in its phase (Pending until learners run) with condition PodsUnschedulable saying which
pod waits, since when and the scheduler's own message. Only an explicit limit ends the wait:
spec.runPolicy.schedulingTimeoutSeconds (Failed/SchedulingTimeoutExceeded), or
activeDeadlineSeconds, which counts from the start, waiting included (Failed/DeadlineExceeded).
Preempted and evicted pods are losses (pods.py), not this.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diloco.operator import conditions as c
from diloco.operator import failures

TIMED_OUT = "SchedulingTimeoutExceeded"  # the Failed condition's reason
WAITING, SCHEDULED = "Unschedulable", "PodsScheduled"  # PodsUnschedulable's reasons (True, False)
FIX = ("no node fits the pod now: compare its nodeSelector, tolerations and resources with the cluster's nodes "
       "(kubectl describe pod), or add capacity; the job starts when a node fits")


@dataclass(frozen=True)
class Waiting:
    """One pod the scheduler could not place, since `since` (Unix seconds)."""

    pod: str
    who: str  # "learner us-1", "syncer"
    since: float
    message: str  # the scheduler's, e.g. "0/3 nodes are available: 3 Insufficient google.com/tpu."

    def seconds(self, now: float) -> float:
        return max(0.0, now - self.since)


def _time(value: str | None) -> float | None:
    if not value:
        return None
    parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()


def waiting(pods: Iterable[dict[str, Any]], now: float) -> list[Waiting]:
    """The pods the scheduler marked Unschedulable, longest waiting first (pods being deleted
    are going anyway and do not count)."""
    out = []
    for pod in pods:
        meta, s = pod.get("metadata", {}), pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        sched = next((x for x in s.get("conditions") or [] if x.get("type") == "PodScheduled"), None)
        if not sched or sched.get("status") != "False" or sched.get("reason") != "Unschedulable":
            continue
        since = _time(sched.get("lastTransitionTime")) or _time(meta.get("creationTimestamp")) or now
        out.append(Waiting(meta.get("name", "?"), failures.who(pod), since, sched.get("message") or "no node fits"))
    return sorted(out, key=lambda w: (w.since, w.pod))


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
