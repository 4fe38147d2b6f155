"""The reconcile's second step, pure: from what one pass observed (operator/reconcile/observe.py) and the
clock, the Plan: the children to converge to, the job's status, the Events and metric counts,
the pods to delete and the Workload writes. No client, no clock of its own, no I/O: tested as
tables of observed -> plan (tests/operator/reconcile/test_plan.py). operator/reconcile/apply.py carries it out.

The only things a plan cannot know are the answers to its writes: which child writes the API
server refuses (a quota, a webhook, RBAC: operator/failures/refusals.py), and which pods the controllers cannot
create for the children as written (operator/failures/pod_refusals.py, read from the workloads the sync returns);
`settle` folds those into the status once they are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.contract import LearnerId
from diloco.operator.admission import immutable
from diloco.operator.failures import capacity, gang_plan, pod_refusals, pods, readmission, refusals
from diloco.operator.failures import policy as failures
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import lifecycle, placement, queueing
from diloco.operator.reconcile import children
from diloco.operator.reconcile.actions import Count, Event, PodDelete, WorkloadWrite
from diloco.operator.reconcile.observe import Observed, syncer_ready, target
from diloco.operator.render import access, exposure, learners, policies
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.operator.status import conditions as c
from diloco.operator.status import goodput, steps
from diloco.operator.status import job as st
from diloco.spec import DecoupledDiLoCoJob


@dataclass(frozen=True)
class Plan:
    """What one pass over a job does, in the order operator/reconcile/apply.py does it."""

    ref: dict[str, Any]  # the job, for Events
    outcome: str  # the reconciles metric's label: ok, or invalid (a spec that cannot run here)
    old: dict[str, Any]  # the status as read
    status: dict[str, Any]  # the status this pass computes (before the child writes' refusals: `settle`)
    replace: dict[str, Any] | None = None  # a held Kueue Workload to delete (an older shape of the job)
    suspend: bool | None = None  # spec.suspend to write (Kueue's admission)
    early: tuple[Event, ...] = ()  # Kueue's Events, posted before the children are written
    desired: list[dict[str, Any]] | None = None  # the children to converge to; None: leave them alone
    live: dict[children.Key, Any] = field(default_factory=dict)  # the children `children` is computed from
    children: children.Plan = field(default_factory=children.Plan)  # what to apply and delete
    pods: list[dict[str, Any]] | None = None  # the job's pods, whose refusals are read once the children are
    # written (None: a finished job's, not read)
    events: tuple[Event | Count, ...] = ()  # after the children: Events and metric counts, in order
    pod_deletes: tuple[PodDelete, ...] = ()
    workload_writes: tuple[WorkloadWrite, ...] = ()
    stamp: str = ""  # the pass's time as conditions write it
    generation: int = 0
    capacity_tokens: float | None = None  # goodput's capacity, for the job's metrics
    waiting: tuple[int, float] = (0, 0.0)  # pods waiting for capacity, and the longest wait in seconds
    delete_job: Event | None = None  # a finished job past its TTL: deleted, with this Event


@dataclass(frozen=True)
class Settled:
    """The status once the child writes' refusals are known, and what shows them."""

    status: dict[str, Any]
    patch: dict[str, Any]  # what changed: the status write (empty: none)
    events: tuple[Event | Count, ...]


def plan(o: Observed, now: float) -> Plan:
    """The pass over `o`'s job at `now`."""
    meta, status = o.body["metadata"], o.status
    generation = int(meta.get("generation") or 0)
    ref = n.job_reference(meta["name"], meta["namespace"], meta["uid"])
    if o.job is None:
        new = st.invalid(status, o.problems, generation, now)
        told = (Event("InvalidSpec", "; ".join(o.problems), warning=True),) if st.changed(status, new) else ()
        return Plan(ref, "invalid", status, new, events=told, generation=generation)
    job, owner, config = o.job, o.owner, o.config
    link = access.link(job, owner.namespace, o.secrets)
    blocker = access.secret_blocker(job, o.secrets)
    if o.probed:
        blocker = access.refused(job, link, o.syncer[1])
    was_finished = st.finished(status)
    live = dict(o.live)
    q: queueing.Queued | None = None  # the job's pass through Kueue, when queued
    if o.queue is not None:
        assert o.kueue is not None
        q = queueing.decide(job, o.kueue, owner=owner, link=link, queue_name=o.queue, live=live,
                            finished=was_finished, generation=generation)
        job = q.job
        for k in q.dropped:
            live.pop(k, None)
    gate, queued, placed = (q.gate, q.workloads, q.placed) if q is not None else (None, [], {})
    job_pods = o.pods
    # The pods whose state is the job's: waiting for capacity (operator/failures/capacity.py) or failing (operator/failures/policy.py).
    spec = job.spec
    mine = [] if was_finished else failures.counting(job_pods, lambda slot: st.slot_wanted(spec, slot))
    obs = _observation(o, job, job_pods=job_pods, live=live, blocker=blocker, now=now, mine=mine)
    counted, fresh = ({}, []) if was_finished else failures.fold(status, mine, now)
    events: list[Event | Count] = [Event(reason, message, warning=True) for reason, message in
                                   failures.events(status, fresh, job.spec.run_policy.backoff_limit)]
    ended = None if was_finished else st.ending(job.spec, {**status, **counted}, obs)
    stamp = st.rfc3339(now)
    new = st.compute(job.spec, {**status, **counted}, obs, generation=generation, ended=ended)
    new = immutable.condition(immutable.record(status, new, owner.uid, job.spec), status, problems=o.refused,
                              now=stamp, generation=generation)
    new["conditions"] = kueue.condition(new["conditions"], gate, stamp, generation)
    if gate is not None and gate.reason in kueue.TROUBLE and \
            (c.find(status.get("conditions") or [], kueue.JOB_ADMITTED) or {}).get("reason") != gate.reason:
        events.append(Event(gate.reason, gate.message, warning=True))
    if immutable.newly_refused(status, o.refused):
        events.append(Event("SpecImmutable", "; ".join(o.refused), warning=True))
    if ended is None:
        rendered = render.children(job, owner, o.token, started=st.started(status), finished=was_finished,
                                   blocked=blocker is not None, link=link, outcome=policies.outcome(status),
                                   expose_annotations=config.expose_annotations, peers=config.peers)
    else:
        # The pods spec.runPolicy.cleanPodPolicy names go; the checkpoint volume, config and token stay.
        rendered = render.children(job, owner, o.token, started=True, finished=True, link=link,
                                   outcome=policies.outcome(new), peers=config.peers)
        events.append(Event(ended.reason, ended.message, warning=not ended.succeeded))
    desired = placement.place(rendered, placed) + queued
    if (waiting := capacity.started_waiting(status.get("conditions") or [], new["conditions"])) is not None:
        events.append(Event(capacity.WAITING, waiting["message"], warning=True))
    deletes = [_force_delete(pod, ref, config.stuck_timeout) for pod in pods.stuck(job_pods, now, config.stuck_timeout)]
    new = _readmit_ready(new, job_pods, ref, events)
    if ended is None and not was_finished and blocker is None and not job.spec.suspend:
        new = _settle_gangs(job, new, job_pods, ref, now=now, finished=set(obs.finished), events=events,
                            deletes=deletes)
    if blocker is not None and _running_reason(status) != blocker.reason:
        events.append(Event(blocker.reason, blocker.message, warning=True))
    writes: list[WorkloadWrite] = []
    if q is not None and q.current is not None and st.finished(new):
        # Kueue frees a finished job's quota.
        done = lifecycle.finish(q.current, succeeded=c.is_true(new["conditions"], c.SUCCEEDED),
                                      message="the job finished", now=stamp)
        writes = [WorkloadWrite(q.current, done)] if done is not None else []
    elif q is not None:
        writes = queueing.settle(q, job_pods, finished=was_finished, now=stamp)
    return Plan(ref, "ok", status, new, replace=q.replace if q else None, suspend=q.suspend if q else None,
                early=q.events if q else (), desired=desired, live=live,
                children=children.plan(desired, list(live.values()), owner.uid), pods=None if was_finished else job_pods,
                events=tuple(events), pod_deletes=tuple(deletes), workload_writes=tuple(writes), stamp=stamp,
                generation=generation, capacity_tokens=goodput.capacity_tokens(job.spec, new.get("accounting") or {}),
                waiting=(len(obs.unschedulable), obs.unschedulable[0].seconds(now) if obs.unschedulable else 0.0),
                delete_job=_expired(job, status, new, now))


def settle(p: Plan, refused_writes: list[refusals.Refusal], refusing: pod_refusals.Observed | None) -> Settled:
    """Refused child writes and pods as the job shows them: condition ChildrenRefused, a Warning
    Event when they change, and the metric, counted per refused write and per pass a pod is
    refused (operator/failures/refusals.py, operator/failures/pod_refusals.py: `refusing`, read once the children were written);
    and the status write, only what changed."""
    if p.outcome != "ok":
        return Settled(p.status, st.changed(p.old, p.status), ())
    found = [*refused_writes, *(pod_refusals.found(refusing) if refusing is not None else [])]
    events: list[Event | Count] = [Count("refused_writes", (r.kind, r.reason)) for r in found]
    conds = refusals.condition(p.status["conditions"], found, p.stamp, p.generation)
    events += [Event(r.reason, r.describe(), warning=True)
               for r in refusals.news(p.old.get("conditions") or [], conds, found)]
    new = {**p.status, "conditions": conds}
    return Settled(new, st.changed(p.old, new), tuple(events))


def _observation(o: Observed, job: DecoupledDiLoCoJob, *, job_pods: list[dict[str, Any]],
                 live: dict[children.Key, Any], blocker: access.Blocker | None, now: float,
                 mine: list[dict[str, Any]]) -> st.Observation:
    owner = o.owner
    ready = {g.name: learners.ready_learners(g, job_pods) for g in job.spec.learner_groups}
    view, error = o.syncer
    # An external syncer was asked before the learners were rendered; the job's own, once ready.
    ready_syncer = view is not None if o.probed else syncer_ready(job, live)
    syncer_pods = [x for x in job_pods if (x["metadata"].get("labels") or {}).get(n.COMPONENT) == n.SYNCER]
    return st.Observation(
        now=now, ready=ready, syncer_endpoint=target(o.config, job, owner, o.secrets, o.token).address,
        syncer_ready=ready_syncer, syncer_restarts=pods.restarts(syncer_pods), syncer=view, syncer_error=error,
        exposed_address=exposure.address(job, live.get(("Service", n.exposed_syncer(owner.name)))), blocker=blocker,
        unschedulable=tuple(capacity.waiting(mine, now, o.config.gate_grace)),
        image_stuck=failures.image_stuck(mine, now, o.config.image_pull_grace), finished=steps.finished(job.spec, mine))


def _force_delete(pod: dict[str, Any], ref: dict[str, Any], timeout: float) -> PodDelete:
    """A pod Terminating past its grace period (a dead node's) holds its slot: deleted now."""
    meta, job = pod["metadata"], ref["metadata"]
    return PodDelete(meta["name"], meta.get("uid"), grace_seconds=0, then=(
        Count("forced_deletions", (job["namespace"], job["name"])),
        Event("PodForceDeleted", f"pod {meta['name']} was Terminating past its grace period by over {timeout:.0f} s",
              warning=True)))


def _running_reason(status: dict[str, Any]) -> str:
    return str((c.find(status.get("conditions") or [], c.RUNNING) or {}).get("reason", ""))


def _readmit_ready(new: dict[str, Any], job_pods: list[dict[str, Any]], ref: dict[str, Any],
                   events: list[Event | Count]) -> dict[str, Any]:
    """Re-admit lost slots whose pod is ready but whose event was missed or came out of order
    (multi-host learners: `_settle_gangs`)."""
    for pod in job_pods:
        found = n.learner_of(pod)
        if found is None or (pod["metadata"].get("labels") or {}).get(n.GANG):
            continue
        back = readmission.decide(new, ref, found[1], [pod])
        if back is not None:
            new = {**new, **back.patch}
            events.extend(back.then)
    return new


def _settle_gangs(job: DecoupledDiLoCoJob, new: dict[str, Any], job_pods: list[dict[str, Any]],
                  ref: dict[str, Any], *, now: float, finished: set[str], events: list[Event | Count],
                  deletes: list[PodDelete]) -> dict[str, Any]:
    """Every multi-host learner: record its run, restart it as a whole if it lost a host,
    re-admit it once all its hosts are back. One that finished its steps is left alone: its
    hosts exit 0 one by one, which is no lost host (operator/status/steps.py)."""
    namespace, name = ref["metadata"]["namespace"], ref["metadata"]["name"]
    for group in job.spec.learner_groups:
        if not learners.is_gang(group):
            continue
        for i in range(group.replicas):
            learner = LearnerId(group.name, i)
            if str(learner) in finished:
                continue
            members = [p for p in job_pods if (p.get("metadata", {}).get("labels") or {}).get(n.GANG) ==
                       n.gang(name, group.name, i)]
            step = gang_plan.settle(new, namespace=namespace, job=name, learner=learner,
                                    hosts=group.hosts_per_learner, gang_pods=members, now=now)
            new = {**new, **step.patch}
            deletes.extend(PodDelete(p["metadata"]["name"], p["metadata"].get("uid")) for p in step.delete)
            events.extend(step.then)
            back = readmission.decide(new, ref, learner, members, hosts=group.hosts_per_learner)
            if back is not None:
                new = {**new, **back.patch}
                events.extend(back.then)
    return new


def _expired(job: DecoupledDiLoCoJob, status: dict[str, Any], new: dict[str, Any], now: float) -> Event | None:
    """A finished job past spec.runPolicy.ttlSecondsAfterFinished: deleted, with this Event."""
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    done_at = st.parse_time(new.get("completionTime") or status.get("completionTime"))
    if ttl is None or done_at is None or now - done_at < ttl:
        return None
    return Event("TTLExpired", f"finished {now - done_at:.0f} s ago; deleting (ttlSecondsAfterFinished={ttl})")
