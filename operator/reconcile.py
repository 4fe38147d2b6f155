"""One level-triggered pass over a job, and the pod-event and chaos passes.

Every pass re-reads the job under its lock, so create, update, resume and the timers all
call the same code and converge on the same state; the pure modules (render, children,
status, pods, chaos, failures, immutable) decide, this module only reads, writes and posts Events.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from secrets import token_urlsafe
from typing import Any

from diloco.contract import LearnerId
from diloco.operator import (
    access,
    admission,
    capacity,
    children,
    exposure,
    failures,
    gangs,
    goodput,
    immutable,
    kueue,
    kueue_io,
    kueue_placement,
    learners,
    pod_refusals,
    pods,
    policies,
    queueing,
    refusals,
    render,
    restarts,
    steps,
)
from diloco.operator import chaos as chaos_mod
from diloco.operator import conditions as c
from diloco.operator import naming as n
from diloco.operator import status as st
from diloco.operator.context import Context, post
from diloco.operator.syncer_client import Target
from diloco.spec import KIND, DecoupledDiLoCoJob, SpecError, parse_job

log = logging.getLogger("diloco.operator")


def load(body: dict[str, Any]) -> tuple[DecoupledDiLoCoJob | None, list[str]]:
    """The validated job, or the problems (each naming its field path)."""
    meta = body.get("metadata", {})
    try:
        # Labels and annotations too: Kueue's (kueue.py) are read from the job's.
        job = parse_job({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                         "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                                      "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}},
                         "spec": body.get("spec")})
    except SpecError as exc:
        return None, exc.problems
    problems = admission.spec_problems(job)
    return (None, problems) if problems else (job, [])


def _effective(body: dict[str, Any]) -> tuple[DecoupledDiLoCoJob | None, list[str], list[str]]:
    """(the job to run, its problems, the refused changes): a started job whose edit changes an
    immutable field runs on with the values it started with (immutable.py)."""
    job, problems = load(body)
    was = immutable.started(body)
    if job is None or was is None:
        return (immutable.pinned(job) if job is not None else None), problems, []
    # Compared as this operator reads the record: a field added since it was written has its default.
    kept, kept_problems = load(immutable.restore(body, was))
    refused = immutable.refused(immutable.values(kept.spec) if kept else was, job.spec)
    if refused:
        return kept, refused + kept_problems if kept_problems else [], refused
    # Nothing refused: the same spec, with the data's started shard count pinned where it is unset.
    return (kept, [], []) if kept is not None else (job, problems, [])


def _token(ctx: Context, job: DecoupledDiLoCoJob, owner: render.Owner, secrets: access.Secrets) -> str:
    """The job's token: the home job's copy in a learners-only cluster; else kept from the job's
    own Secret once it exists, generated only the first time."""
    ext = job.spec.syncer.external
    if ext is not None:
        raw = access.value(secrets.get(ext.token_secret), n.TOKEN_KEY)
        return raw.decode("utf-8", "replace").strip() if raw else ""
    raw = access.value(ctx.api.get("Secret", owner.namespace, n.token_secret(owner.name)), n.TOKEN_KEY)
    return raw.decode() if raw else token_urlsafe(32)


def _target(ctx: Context, job: DecoupledDiLoCoJob, *, owner: render.Owner, link: access.Link, token: str,
            secrets: access.Secrets) -> Target:
    """The syncer as the operator dials it: like the learners, with the same token and CA."""
    external = job.spec.syncer.external is not None
    # A sharded syncer is dialled shard by shard, by the pods' names (the config's override, for
    # tests, maps the one Service of an unsharded syncer).
    sharded = job.spec.syncer.shards > 1
    address = link.address if external or sharded else ctx.config.syncer_address(owner.name, owner.namespace)
    ca = access.value(secrets.get(link.ca_secret), n.CA_KEY) if link.ca_secret else None
    return Target(address, token, ca, link.server_name)


def _observe(ctx: Context, job: DecoupledDiLoCoJob, *, owner: render.Owner, live: dict[children.Key, Any],
             job_pods: list[dict[str, Any]], target: Target, probe: tuple[st.SyncerView | None, str] | None,
             blocker: access.Blocker | None, now: float) -> st.Observation:
    ready = {g.name: learners.ready_learners(g, job_pods) for g in job.spec.learner_groups}
    if probe is not None:  # an external syncer: asked before the learners were rendered
        view, error = probe
        syncer_ready = view is not None
    else:
        kind = "Deployment" if job.spec.syncer.shards == 1 else "StatefulSet"  # one pod per shard
        workload = live.get((kind, n.syncer(owner.name))) or {}
        ready_pods = int((workload.get("status") or {}).get("readyReplicas") or 0)
        syncer_ready = ready_pods >= job.spec.syncer.shards
        view, error = ctx.syncers.status(owner.namespace, owner.name, target) if syncer_ready else (None, "")
    syncer_pods = [x for x in job_pods if (x["metadata"].get("labels") or {}).get(n.COMPONENT) == n.SYNCER]
    exposed = exposure.address(job, live.get(("Service", n.exposed_syncer(owner.name))))
    return st.Observation(now=now, ready=ready, syncer_endpoint=target.address, syncer_ready=syncer_ready,
                          syncer_restarts=pods.restarts(syncer_pods), syncer=view, syncer_error=error,
                          exposed_address=exposed, blocker=blocker)


def reconcile(ctx: Context, namespace: str, name: str) -> None:
    """Children to match the spec, then the status to match what is observed."""
    with ctx.lock(namespace, name):
        body = ctx.api.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            _reconcile(ctx, body, time.time())
        except Exception:  # kopf logs it and retries; the counter makes it visible to alerts
            ctx.metrics.reconciles.labels("error").inc()
            raise


def _reconcile(ctx: Context, body: dict[str, Any], now: float) -> None:
    meta, status = body["metadata"], body.get("status") or {}
    namespace, name, generation = meta["namespace"], meta["name"], int(meta.get("generation") or 0)
    ref = n.job_reference(name, namespace, meta["uid"])
    job, problems, refused = _effective(body)
    live: dict[children.Key, Any] | None = None  # observed once, for the shard check and the sync
    queue = kueue.queue(ctx.config.kueue, meta.get("labels"))  # queued in Kueue: kueue.py
    if job is not None:
        problems, live = _install_problems(ctx, job, namespace, name, queued=queue is not None)
        job = None if problems else job
    if job is None:
        _invalid(ctx, ref, status=status, problems=problems, generation=generation, now=now)
        return
    owner = render.Owner(name, namespace, meta["uid"])
    secrets = {secret: ctx.api.get("Secret", namespace, secret) for secret, _, _ in access.referenced(job)}
    token = _token(ctx, job, owner, secrets)
    link = access.link(job, namespace, secrets)
    target = _target(ctx, job, owner=owner, link=link, token=token, secrets=secrets)
    blocker, probe = access.secret_blocker(job, secrets), None
    if blocker is None and job.spec.syncer.external is not None:
        # Before any learner exists: a token the syncer refuses would only make them crash-loop.
        probe = ctx.syncers.status(namespace, name, target)
        blocker = access.refused(job, link, probe[1])
    was_finished = st.finished(status)
    q: queueing.Queued | None = None  # the job's pass through Kueue, when queued
    if queue is not None:
        live = live if live is not None else children.observe(ctx.api, namespace, name, ctx.config.managed_kinds)
        q = queueing.queue(ctx, ref, job, owner=owner, link=link, queue_name=queue, live=live, finished=was_finished,
                           generation=generation)
        job = q.job
    gate, queued, placed = (q.gate, q.workloads, q.placed) if q is not None else (None, [], {})
    desired = kueue_placement.place(render.children(job, owner, token, started=st.started(status), finished=was_finished,
                                          blocked=blocker is not None, link=link, outcome=policies.outcome(status),
                                          expose_annotations=ctx.config.expose_annotations, peers=ctx.config.peers),
                          placed) + queued
    live, done = children.sync(ctx.api, namespace, name, owner_uid=owner.uid, desired=desired,
                               kinds=ctx.config.managed_kinds, live=live)
    if done.apply or done.delete:
        log.info("%s/%s: %s", namespace, name, ", ".join(done.summary()))
        post(ref, "ChildrenUpdated", ", ".join(done.summary()))
    job_pods = ctx.api.list("Pod", namespace, n.selector(name))
    # Pods the controllers may not create, or the kubelet not start (pod_refusals.py).
    refused_pods = [] if was_finished else pod_refusals.found(pod_refusals.read(ctx.api, namespace, live, job_pods))
    # The pods whose state is the job's: waiting for capacity (capacity.py) or failing (failures.py).
    mine = [] if was_finished else failures.counting(job_pods, lambda slot: st.slot_wanted(job.spec, slot))
    obs = replace(_observe(ctx, job, owner=owner, live=live, job_pods=job_pods, target=target, probe=probe,
                           blocker=blocker, now=now),
                  unschedulable=tuple(capacity.waiting(mine, now, ctx.config.gate_grace)),
                  image_stuck=failures.image_stuck(mine, now, ctx.config.image_pull_grace),
                  finished=steps.finished(job.spec, mine))
    counted, fresh = ({}, []) if was_finished else failures.fold(status, mine, now)
    for reason, message in failures.events(status, fresh, job.spec.run_policy.backoff_limit):
        post(ref, reason, message, warning=True)
    ended = None if was_finished else st.ending(job.spec, {**status, **counted}, obs)
    new = st.compute(job.spec, {**status, **counted}, obs, generation=generation, ended=ended)
    new = immutable.condition(immutable.record(status, new, owner.uid, job.spec), status, problems=refused,
                              now=st.rfc3339(now), generation=generation)
    new["conditions"] = kueue.condition(new["conditions"], gate, st.rfc3339(now), generation)
    if gate is not None and gate.reason in kueue.TROUBLE and \
            (c.find(status.get("conditions") or [], kueue.JOB_ADMITTED) or {}).get("reason") != gate.reason:
        post(ref, gate.reason, gate.message, warning=True)
    if immutable.newly_refused(status, refused):
        post(ref, "SpecImmutable", "; ".join(refused), warning=True)
    if ended is not None:
        # The pods spec.runPolicy.cleanPodPolicy names go; the checkpoint volume, config and token stay.
        desired = kueue_placement.place(render.children(job, owner, token, started=True, finished=True, link=link,
                                              outcome=policies.outcome(new), peers=ctx.config.peers), placed) + queued
        _, cleaned = children.sync(ctx.api, namespace, name, owner_uid=owner.uid, desired=desired,
                                   kinds=ctx.config.managed_kinds)
        done.refused.extend(cleaned.refused)
        post(ref, ended.reason, ended.message, warning=not ended.succeeded)
    new = _show_refusals(ctx, ref, status=status, new=new, found=[*done.refused, *refused_pods],
                         stamp=st.rfc3339(now),
                         generation=generation)
    if (waiting := capacity.started_waiting(status.get("conditions") or [], new["conditions"])) is not None:
        post(ref, capacity.WAITING, waiting["message"], warning=True)
    _force_delete_stuck(ctx, ref, job_pods, now)
    new = _readmit_ready(ctx, ref, new, job_pods)
    if ended is None and not was_finished and blocker is None and not job.spec.suspend:
        new = _settle_gangs(ctx, ref, job, new=new, job_pods=job_pods, now=now, finished=set(obs.finished))
    if blocker is not None and _running_reason(status) != blocker.reason:
        post(ref, blocker.reason, blocker.message, warning=True)
    if q is not None and q.current is not None and st.finished(new):
        # Kueue frees a finished job's quota.
        kueue_io.finish(ctx.api, q.current, succeeded=c.is_true(new["conditions"], c.SUCCEEDED),
                     message="the job finished", now=st.rfc3339(now))
    elif q is not None:
        queueing.settle(ctx, ref, q, job_pods, finished=was_finished, now=st.rfc3339(now))
    _publish(ctx, ref, job, status=status, new=new, obs=obs, now=now)


def _install_problems(ctx: Context, job: DecoupledDiLoCoJob, namespace: str, name: str, *, queued: bool
                      ) -> tuple[list[str], dict[children.Key, Any] | None]:
    """What keeps a valid spec from running here (admission.py), and the live children where
    they were read to see whether the syncer's shard count would change under a running job."""
    problems = admission.install_problems(job, gateway_api=ctx.config.gateway_api, queued=queued)
    if problems or job.spec.syncer.external is not None:
        return problems, None
    live = children.observe(ctx.api, namespace, name, ctx.config.managed_kinds)
    changed = render.shard_change_problem(job, live.get(("Deployment", n.syncer(name))),
                                          live.get(("StatefulSet", n.syncer(name))))
    return problems + ([changed] if changed else []), live


def _invalid(ctx: Context, ref: dict[str, Any], *, status: dict[str, Any], problems: list[str], generation: int,
             now: float) -> None:
    """A job whose spec cannot run: phase Failed, the problems in its status and one Event."""
    namespace, name = ref["metadata"]["namespace"], ref["metadata"]["name"]
    new = st.invalid(status, problems, generation, now)
    if st.changed(status, new):
        ctx.api.patch(KIND, namespace, name, {"status": new}, sub="status")
        post(ref, "InvalidSpec", "; ".join(problems), warning=True)
    ctx.metrics.job_status(namespace, name, new)  # its phase: Failed
    ctx.metrics.reconciles.labels("invalid").inc()


def _force_delete_stuck(ctx: Context, ref: dict[str, Any], job_pods: list[dict[str, Any]], now: float) -> None:
    """Pods Terminating past their grace period (a dead node's) hold their slot: delete them now."""
    namespace, name = ref["metadata"]["namespace"], ref["metadata"]["name"]
    for pod in pods.stuck(job_pods, now, ctx.config.stuck_timeout):
        pod_meta = pod["metadata"]
        if ctx.api.delete("Pod", namespace, pod_meta["name"], grace_seconds=0, uid=pod_meta.get("uid")):
            ctx.metrics.forced_deletions.labels(namespace, name).inc()
            post(ref, "PodForceDeleted", f"pod {pod_meta['name']} was Terminating past its grace period "
                                         f"by over {ctx.config.stuck_timeout:.0f} s", warning=True)


def _publish(ctx: Context, ref: dict[str, Any], job: DecoupledDiLoCoJob, *, status: dict[str, Any],
             new: dict[str, Any], obs: st.Observation, now: float) -> None:
    """The new status written (only what changed), the metrics, and a finished job past its TTL deleted."""
    meta = ref["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    diff = st.changed(status, new)
    if diff:
        ctx.api.patch(KIND, namespace, name, {"status": diff}, sub="status")
    ctx.metrics.job_status(namespace, name, new, goodput.capacity_tokens(job.spec, new.get("accounting") or {}))
    ctx.metrics.capacity_wait(namespace, name, len(obs.unschedulable),
                              obs.unschedulable[0].seconds(now) if obs.unschedulable else 0.0)
    ctx.metrics.reconciles.labels("ok").inc()
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    done_at = st.parse_time(new.get("completionTime") or status.get("completionTime"))
    if ttl is not None and done_at is not None and now - done_at >= ttl:
        post(ref, "TTLExpired", f"finished {now - done_at:.0f} s ago; deleting (ttlSecondsAfterFinished={ttl})")
        ctx.api.delete(KIND, namespace, name, uid=meta["uid"])


def _show_refusals(ctx: Context, ref: dict[str, Any], *, status: dict[str, Any], new: dict[str, Any],
                   found: list[refusals.Refusal], stamp: str, generation: int) -> dict[str, Any]:
    """Refused child writes and pods as the job shows them: condition ChildrenRefused, a Warning
    Event when they change, and the metric, counted per refused write and per pass a pod is
    refused (refusals.py, pod_refusals.py)."""
    meta = ref["metadata"]
    for r in found:
        ctx.metrics.refused_writes.labels(r.kind, r.reason).inc()
    conds = refusals.condition(new["conditions"], found, stamp, generation)
    for r in refusals.news(status.get("conditions") or [], conds, found):
        log.warning("%s/%s: %s", meta["namespace"], meta["name"], r.describe())
        post(ref, r.reason, r.describe(), warning=True)
    return {**new, "conditions": conds}


def _running_reason(status: dict[str, Any]) -> str:
    return str((c.find(status.get("conditions") or [], c.RUNNING) or {}).get("reason", ""))


def _readmit_ready(ctx: Context, ref: dict[str, Any], new: dict[str, Any],
                   job_pods: list[dict[str, Any]]) -> dict[str, Any]:
    """Re-admit lost slots whose pod is ready but whose event was missed or came out of order
    (multi-host learners: `_settle_gangs`)."""
    for pod in job_pods:
        found = n.learner_of(pod)
        if found is None or (pod["metadata"].get("labels") or {}).get(n.GANG) or not pods.ready(pod):
            continue
        patch = pods.record_ready(new, found[1])
        if patch is not None:
            new = {**new, **patch}
            _readmitted(ctx, ref, found[1], f"pod {pod['metadata']['name']} is ready")
    return new


def _settle_gangs(ctx: Context, ref: dict[str, Any], job: DecoupledDiLoCoJob, *, new: dict[str, Any],
                  job_pods: list[dict[str, Any]], now: float, finished: set[str]) -> dict[str, Any]:
    """Every multi-host learner: record its run, restart it as a whole if it lost a host,
    re-admit it once all its hosts are back. One that finished its steps is left alone: its
    hosts exit 0 one by one, which is no lost host (steps.py)."""
    name = ref["metadata"]["name"]
    for group in job.spec.learner_groups:
        if not learners.is_gang(group):
            continue
        for i in range(group.replicas):
            learner = LearnerId(group.name, i)
            if str(learner) in finished:
                continue
            members = restarts.members(job_pods, n.gang(name, group.name, i))
            new = {**new, **restarts.settle(ctx, ref, status=new, learner=learner, hosts=group.hosts_per_learner,
                                            gang_pods=members, now=now)}
            new = {**new, **_readmit_gang(ctx, ref, status=new, learner=learner, hosts=group.hosts_per_learner,
                                          members=members)}
    return new


def _readmit_gang(ctx: Context, ref: dict[str, Any], *, status: dict[str, Any], learner: LearnerId, hosts: int,
                  members: list[dict[str, Any]]) -> dict[str, Any]:
    if not gangs.back(members, hosts, gangs.run_of(status, str(learner))):
        return {}
    patch = pods.record_ready(status, learner)
    if patch is None:
        return {}
    _readmitted(ctx, ref, learner, f"all {hosts} hosts are ready")
    return patch


def _readmitted(ctx: Context, ref: dict[str, Any], learner: LearnerId, why: str) -> None:
    meta = ref["metadata"]
    log.info("%s/%s: learner %s re-admitted", meta["namespace"], meta["name"], learner)
    ctx.metrics.readmissions.labels(meta["namespace"], meta["name"], learner.group).inc()
    post(ref, "LearnerReadmitted", f"learner {learner} is back: {why}")


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
        back = pods.ready(pod)
        members = ctx.api.list("Pod", namespace, n.gang_selector(job_name, learner.group, learner.index)) \
            if gang else [pod]
        if steps.finished(job.spec, members):
            return  # it reached spec.training.steps and exited 0: no loss; the reconcile ends the job
        if gang:
            gone = pod if event_type == "DELETED" else None
            patch = restarts.settle(ctx, ref, status=status, learner=learner, hosts=group.hosts_per_learner,
                                    gang_pods=members, now=now, gone=gone)
            back = gangs.back(members, group.hosts_per_learner, gangs.run_of({**status, **patch}, str(learner)))
        current = {**status, **patch}
        if lost is not None:
            patch.update(_lose(ctx, ref, status=current, learner=learner, lost=lost, pod=pod, now=now))
        elif back:
            readmit = pods.record_ready(current, learner)
            if readmit is not None:
                patch.update(readmit)
                _readmitted(ctx, ref, learner, f"all {group.hosts_per_learner} hosts are ready" if gang
                            else f"pod {pod['metadata']['name']} is ready")
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
    restarts as a whole, restarts.py)."""
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
