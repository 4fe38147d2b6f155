"""What a pass decided to do, as data: the plans (operator/reconcile/plan.py, operator/kueue/queueing.py) return these and
operator/reconcile/apply.py carries them out, so every decision can be read and tested without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the job."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class Count:
    """One increment of an operator metric (metrics.OperatorMetrics' counter `metric`), by its labels."""

    metric: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class PodDelete:
    """A pod to delete (the uid a precondition: never a newer pod of the same name); `then`: what
    follows once the API server deleted it (a forced deletion's Event and count), nothing if it was gone."""

    name: str
    uid: str | None
    grace_seconds: int | None = None  # None: the pod's own grace period
    then: tuple[Event | Count, ...] = ()


@dataclass(frozen=True)
class WorkloadWrite:
    """A Workload status write (operator/kueue/api.py write, guarded by its resourceVersion); `event`: posted
    only once it is written (a conflict waits for the next pass)."""

    workload: dict[str, Any]
    status: dict[str, Any]
    event: Event | None = None
