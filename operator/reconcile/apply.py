"""The reconcile's last step: carry out a Plan (operator/reconcile/plan.py). It only writes, posts and
counts, in the order a pass always did: Kueue's Workload and spec.suspend, the children, the
Events, the pods, the Workload status, the job's status, its metrics, and a job past its TTL.

What the API server answers feeds back only where the plan says it does: a refused child write,
and a pod the controllers cannot create for the children as written (the one read here,
pod_refusals.read), show on the job's status (plan.settle); a pod already gone or a
Workload write that lost a race posts nothing.
"""

from __future__ import annotations

import logging

from diloco.operator.context import Context, post
from diloco.operator.failures import pod_refusals
from diloco.operator.kueue import api as kueue_api
from diloco.operator.reconcile import children
from diloco.operator.reconcile.actions import Count, Event
from diloco.operator.reconcile.plan import Plan, settle
from diloco.operator.remote import sync as remote_sync
from diloco.spec import KIND

log = logging.getLogger("diloco.operator")


def _emit(ctx: Context, p: Plan, item: Event | Count) -> None:
    if isinstance(item, Count):
        getattr(ctx.metrics, item.metric).labels(*item.labels).inc()
        return
    meta = p.ref["metadata"]
    (log.warning if item.warning else log.info)("%s/%s: %s: %s", meta["namespace"], meta["name"], item.reason,
                                                item.message)
    post(p.ref, item.reason, item.message, warning=item.warning)


def apply(ctx: Context, p: Plan) -> None:
    """Make the plan so."""
    meta = p.ref["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if p.replace is not None:  # only once the job's pods are gone (operator/kueue/queueing.py)
        children.remove(ctx.api, namespace, p.replace)
    for wl in p.let_go:
        kueue_api.let_go(ctx.api, wl)
    if p.suspend is not None:
        ctx.api.patch(KIND, namespace, name, {"spec": {"suspend": p.suspend}})
    for event in p.early:
        _emit(ctx, p, event)
    refused, refusing = [], None
    if p.desired is not None:
        live, done = children.sync(ctx.api, namespace, name, owner_uid=meta["uid"], desired=p.desired,
                                   kinds=ctx.config.managed_kinds, live=p.live)
        if done.apply or done.delete:
            _emit(ctx, p, Event("ChildrenUpdated", ", ".join(done.summary())))
        refused = done.refused
        # Pods the controllers may not create, or the kubelet not start, for the children as
        # written (operator/failures/pod_refusals.py: it reads only for a workload short of pods).
        refusing = pod_refusals.read(ctx.api, namespace, live, p.pods) if p.pods is not None else None
    done_remote, failed_remote = remote_sync.carry_out(p.remote_writes)
    if done_remote:
        _emit(ctx, p, Event("RemotePartsUpdated", "; ".join(done_remote)))
    if failed_remote:
        _emit(ctx, p, Event("RemoteWriteFailed", "; ".join(failed_remote), warning=True))
    final = settle(p, refused, refusing)
    for item in (*final.events, *p.events):
        _emit(ctx, p, item)
    for pod in p.pod_deletes:
        if ctx.api.delete("Pod", namespace, pod.name, grace_seconds=pod.grace_seconds, uid=pod.uid):
            for item in pod.then:
                _emit(ctx, p, item)
    for write in p.workload_writes:
        if kueue_api.write(ctx.api, write.workload, write.status) and write.event is not None:
            _emit(ctx, p, write.event)
    if final.patch:
        ctx.api.patch(KIND, namespace, name, {"status": final.patch}, sub="status")
    if p.outcome != "ok":
        ctx.metrics.job_status(namespace, name, final.status)
        ctx.metrics.reconciles.labels(p.outcome).inc()
        return
    ctx.metrics.job_status(namespace, name, final.status, p.capacity_tokens)
    ctx.metrics.capacity_wait(namespace, name, *p.waiting)
    ctx.metrics.reconciles.labels("ok").inc()
    if p.delete_job is not None:
        _emit(ctx, p, p.delete_job)
        ctx.api.delete(KIND, namespace, name, uid=meta["uid"])
