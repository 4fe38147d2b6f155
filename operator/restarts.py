"""Whole-gang restarts as I/O: gangs.py decides; this deletes the survivors, counts, posts.

Runs for every event of a multi-host learner's pod and, for every such learner, on each
reconcile (a missed event, an operator restart), always under the job's lock, so the
recorded runs in the status see each decision before the next.
"""

from __future__ import annotations

import logging
from typing import Any

from diloco.contract import LearnerId
from diloco.operator import gangs, pods
from diloco.operator import naming as n
from diloco.operator.context import Context, post

log = logging.getLogger("diloco.operator")


def members(job_pods: list[dict[str, Any]], gang: str) -> list[dict[str, Any]]:
    """The pods of one multi-host learner among the job's."""
    return [p for p in job_pods if (p.get("metadata", {}).get("labels") or {}).get(n.GANG) == gang]


def settle(ctx: Context, ref: dict[str, Any], *, status: dict[str, Any], learner: LearnerId, hosts: int,
           gang_pods: list[dict[str, Any]], now: float, gone: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the learner's run once all its hosts run, or restart it as a whole when one is
    lost; returns the status patch (empty when nothing changed). `gone`: a pod of it just deleted."""
    meta = ref["metadata"]
    namespace, job = meta["namespace"], meta["name"]
    slot = str(learner)
    decision = gangs.decide(gang_pods, hosts, run=gangs.run_of(status, slot),
                            gang=n.gang(job, learner.group, learner.index), gone=gone)
    patch: dict[str, Any] = {}
    if decision.run is not None:
        patch.update(gangs.set_run(status, slot, decision.run))
    restart = decision.restart
    if restart is None:
        return patch
    for pod in restart.survivors:  # the uid precondition: never a newer pod of the same name
        ctx.api.delete("Pod", namespace, pod["metadata"]["name"], uid=pod["metadata"].get("uid"))
    current = {**status, **patch}
    counted = any(x.get("slot") == slot for x in pods.open_losses(current))
    lost_pod = gangs.by_host(gang_pods, hosts).get(restart.host) or gone or {}
    patch.update(gangs.record_restart(current, learner, restart=restart,
                                      lost_uid=lost_pod.get("metadata", {}).get("uid", ""), now=now))
    if not counted:
        ctx.metrics.losses.labels(namespace, job, learner.group, restart.loss.reason).inc()
    ctx.metrics.restarts.labels(namespace, job, learner.group).inc()
    text = gangs.message(learner, restart)
    log.info("%s/%s: %s", namespace, job, text)
    post(ref, "LearnerRestarting", f"{text}; the other learners keep training", warning=True)
    return patch
