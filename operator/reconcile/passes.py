"""One level-triggered pass over a job, and the pod-event and chaos passes.

Every pass re-reads the job under its lock, so create, update, resume and the timers all
call the same code and converge on the same state. The reconcile is three steps: observe
(operator/reconcile/observe.py) reads, plan (operator/reconcile/plan.py) decides purely, apply
(operator/reconcile/apply.py) writes; the pod-event and chaos passes read, call the pure modules (pods,
readmission, gangs, chaos) and write here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from diloco.contract import LearnerId
from diloco.operator.context import Context, post
from diloco.operator.failures import chaos as chaos_mod
from diloco.operator.failures import pods, readmission, restarts
from diloco.operator.kube import ApiError
from diloco.operator.kueue import api as kueue_api
from diloco.operator.kueue import integration
from diloco.operator.reconcile import apply, observe, plan
from diloco.operator.reconcile.loading import effective as _effective
from diloco.operator.reconcile.loading import load as load
from diloco.operator.remote import sync as remote_sync
from diloco.operator.render import access, learners
from diloco.operator.render import naming as n
from diloco.operator.status import job as st
from diloco.operator.status import steps
from diloco.spec import KIND, DecoupledDiLoCoJob

log = logging.getLogger("diloco.operator")


def reconcile(ctx: Context, namespace: str, name: str) -> None:
    """Children to match the spec, then the status to match what is observed."""
    with ctx.lock(namespace, name):
        body = ctx.api.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            now = time.time()
            apply.apply(ctx, plan.plan(observe.observe(ctx, body, now), now))
        except Exception:  # kopf logs it and retries; the counter makes it visible to alerts
            ctx.metrics.reconciles.labels("error").inc()
            raise


def workload_owner(wl: dict[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the job that controls a Workload; None for anyone else's."""
    meta = wl.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("controller") and ref.get("apiVersion", "").startswith("diloco.dev/"):
            return str(meta.get("namespace")), str(ref["name"])
    return None


def release_workloads(ctx: Context, namespace: str, name: str) -> bool:
    """A job being deleted lets its Kueue Workloads go (the integration's finalizer off each),
    as Kueue's jobframework does for a deleted job (reconciler.go, finalizeWorkloads): the
    garbage collector then deletes them with the job. False when a write lost a race (try again)."""
    if not ctx.config.kueue:
        return True
    try:
        found = ctx.api.list("Workload", namespace, n.selector(name))
    except ApiError as exc:
        if exc.status != 404:  # Kueue not served: nothing of it to let go
            raise
        return True
    return all(kueue_api.let_go(ctx.api, wl) for wl in found
               if integration.FINALIZER in (wl["metadata"].get("finalizers") or []))


def release_remotes(ctx: Context, namespace: str, name: str) -> bool:
    """A multi-cluster job being deleted: its remote parts deleted in their clusters
    (operator/remote/sync.py). False while a cluster holds the deletion back (try again)."""
    body = ctx.api.get(KIND, namespace, name)
    if body is None:
        return True
    whole, _, _ = _effective(body)
    wanted = [(c, c.namespace or namespace) for c in (whole.spec.clusters if whole else [])]
    named = {c.name for c, _ in wanted}
    wanted += [(c, ns) for c, ns in remote_sync.recorded(body.get("status") or {}) if c.name not in named]
    if not wanted:
        return True
    done, waiting = remote_sync.release(ctx.api, ctx.remotes, ctx.config.peers.operator_namespace, body, wanted)
    ref = n.job_reference(name, namespace, body["metadata"]["uid"])
    if done:
        post(ref, "RemotePartsDeleted", "; ".join(done))
    if waiting:
        post(ref, "RemotePartsHeld", "the job waits to delete its remote parts: " + "; ".join(waiting) +
             " (delete the cluster's kubeconfig Secret to give its part up)", warning=True)
    return not waiting


def _readmitted(ctx: Context, ref: dict[str, Any], learner: LearnerId, back: readmission.Readmitted) -> None:
    meta = ref["metadata"]
    log.info("%s/%s: learner %s re-admitted", meta["namespace"], meta["name"], learner)
    getattr(ctx.metrics, back.count.metric).labels(*back.count.labels).inc()
    post(ref, back.event.reason, back.event.message, warning=back.event.warning)


def pod_event(ctx: Context, event_type: str | None, pod: dict[str, Any]) -> None:
    """Count a learner pod lost, or re-admit its slot once a pod for it is ready again; a
    multi-host learner's pod may also restart its whole gang (every event of one counts)."""
    found = n.learner_of(pod)
    if found is None:
        return
    job_name, learner = found
    lost = pods.loss(event_type, pod)
    gang = (pod["metadata"].get("labels") or {}).get(n.GANG)
    if lost is None and not pods.ready(pod) and not gang:
        return
    namespace = pod["metadata"]["namespace"]
    with ctx.lock(namespace, job_name):
        loaded = _job(ctx, namespace, job_name)
        if loaded is None:
            return
        job, status, ref = loaded
        if job is None or not job.spec.runs_here() or st.finished(status) or access.blocked(status) or \
                not st.slot_wanted(job.spec, str(learner)):
            return  # scaled down, suspended, finished, blocked, invalid or not ours: removed on purpose
        group = next(g for g in job.spec.learner_groups if g.name == learner.group)
        if bool(gang) != learners.is_gang(group):
            return  # the group's hostsPerLearner changed: these pods go with their old StatefulSet
        now, patch = time.time(), {}
        members = ctx.api.list("Pod", namespace, n.gang_selector(job_name, learner.group, learner.index)) \
            if gang else [pod]
        if steps.finished(job.spec, members):
            return  # it reached spec.training.steps and exited 0: no loss; the reconcile ends the job
        if gang:
            gone = pod if event_type == "DELETED" else None
            patch = restarts.settle(ctx, ref, status=status, learner=learner, hosts=group.hosts_per_learner,
                                    gang_pods=members, now=now, gone=gone)
        current = {**status, **patch}
        if lost is not None:
            patch.update(_lose(ctx, ref, status=current, learner=learner, lost=lost, pod=pod, now=now))
        elif (back := readmission.decide(current, ref, learner, members, hosts=group.hosts_per_learner)) is not None:
            patch.update(back.patch)
            _readmitted(ctx, ref, learner, back)
        if patch:
            ctx.api.patch(KIND, namespace, job_name, {"status": st.validated(patch)}, sub="status")


def _lose(ctx: Context, ref: dict[str, Any], *, status: dict[str, Any], learner: LearnerId, lost: pods.Loss,
          pod: dict[str, Any], now: float) -> dict[str, Any]:
    """The status patch counting the learner lost (empty if it already is), with its Event."""
    lost = pods.planned(lost, pod, _update_revision(ctx, pod, learner))
    patch = pods.record_loss(status, learner, lost=lost, pod_uid=pod["metadata"].get("uid", ""), now=now)
    if patch is None:
        return {}
    meta = ref["metadata"]
    log.info("%s/%s: learner %s lost (%s)", meta["namespace"], meta["name"], learner, lost.detail)
    ctx.metrics.losses.labels(meta["namespace"], meta["name"], learner.group, lost.reason).inc()
    if lost.planned:
        post(ref, "LearnerRestarted", f"learner {learner} restarted ({lost.reason}): {lost.detail}")
        return patch
    reason = "LearnerPreempted" if lost.reason == pods.PREEMPTED else "LearnerLost"
    post(ref, reason, f"learner {learner} lost ({lost.reason}): {lost.detail}; the others keep training",
         warning=True)
    return patch


def _update_revision(ctx: Context, pod: dict[str, Any], learner: LearnerId) -> str | None:
    """The template revision the pod's StatefulSet now rolls out (None for a gang's pods: a gang
    restarts as a whole, operator/failures/restarts.py)."""
    meta = pod["metadata"]
    if (meta.get("labels") or {}).get(n.GANG):
        return None
    job = (meta.get("labels") or {}).get(n.JOB, "")
    for sts in ctx.api.list("StatefulSet", meta["namespace"], n.selector(job, n.LEARNER, learner.group)):
        if sts["metadata"]["name"] == n.statefulset(job, learner.group):
            return (sts.get("status") or {}).get("updateRevision")
    return None


def _job(ctx: Context, namespace: str, name: str) -> tuple[DecoupledDiLoCoJob | None, dict[str, Any],
                                                          dict[str, Any]] | None:
    """(the job if its spec is valid, its status, a reference for Events), or None if it is gone."""
    body = ctx.api.get(KIND, namespace, name)
    if body is None:
        return None
    job, _, _ = _effective(body)
    return job, body.get("status") or {}, n.job_reference(name, namespace, body["metadata"]["uid"])


def chaos_tick(ctx: Context, namespace: str, name: str) -> None:
    """Make the kills the seeded schedule has due; each one is an Event on the job."""
    with ctx.lock(namespace, name):
        found = _job(ctx, namespace, name)
        if found is None:
            return
        job, status, ref = found
        if job is None or not job.spec.chaos.enabled or job.spec.suspend or status.get("phase") != "Running":
            return
        now = time.time()
        state = chaos_mod.state(job.spec.chaos, status, now)
        job_pods = ctx.api.list("Pod", namespace, n.selector(name))
        kills = chaos_mod.plan(job.spec, state, job_pods, now)
        for kill in kills:
            pod_name = kill.pod["metadata"]["name"]
            ctx.api.patch("Pod", namespace, pod_name, {"metadata": {"annotations": {n.CHAOS: str(kill.number)}}})
            ctx.api.delete("Pod", namespace, pod_name, uid=kill.pod["metadata"].get("uid"))
            ctx.metrics.chaos_kills.labels(namespace, name).inc()
            post(ref, "ChaosKill", f"chaos kill #{kill.number + 1}: deleted pod {pod_name}", warning=True)
        state["kills"] += len(kills)
        if state != status.get("chaos"):
            ctx.api.patch(KIND, namespace, name, {"status": st.validated({"chaos": state})}, sub="status")
