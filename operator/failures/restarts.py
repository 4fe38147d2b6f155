"""Whole-gang restarts as I/O: operator/failures/gangs.py and operator/failures/gang_plan.py decide; this deletes the survivors, counts, posts.

Runs for every event of a multi-host learner's pod and, for every such learner, on each
reconcile (a missed event, an operator restart), always under the job's lock, so the
recorded runs in the status see each decision before the next.
"""

from __future__ import annotations

import logging
from typing import Any

from diloco.contract import LearnerId
from diloco.operator.context import Context, post
from diloco.operator.failures import gang_plan
from diloco.operator.reconcile.actions import Count
from diloco.operator.render import naming as n

log = logging.getLogger("diloco.operator")


def members(job_pods: list[dict[str, Any]], gang: str) -> list[dict[str, Any]]:
    """The pods of one multi-host learner among the job's."""
    return [p for p in job_pods if (p.get("metadata", {}).get("labels") or {}).get(n.GANG) == gang]


def settle(ctx: Context, ref: dict[str, Any], *, status: dict[str, Any], learner: LearnerId, hosts: int,
           gang_pods: list[dict[str, Any]], now: float, gone: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the learner's run once all its hosts run, or restart it as a whole when one is
    lost (operator/failures/gang_plan.py decides); returns the status patch (empty when nothing changed). `gone`: a
    pod of it just deleted."""
    meta = ref["metadata"]
    namespace, job = meta["namespace"], meta["name"]
    step = gang_plan.settle(status, namespace=namespace, job=job, learner=learner, hosts=hosts, gang_pods=gang_pods,
                            now=now, gone=gone)
    for pod in step.delete:  # the uid precondition: never a newer pod of the same name
        ctx.api.delete("Pod", namespace, pod["metadata"]["name"], uid=pod["metadata"].get("uid"))
    for item in step.then:
        if isinstance(item, Count):
            getattr(ctx.metrics, item.metric).labels(*item.labels).inc()
        else:
            log.info("%s/%s: %s", namespace, job, item.message)
            post(ref, item.reason, item.message, warning=item.warning)
    return step.patch
