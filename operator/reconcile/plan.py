"""The reconcile's second step, pure: from what one pass observed (operator/reconcile/observe.py) and the
clock, the Plan: the children to converge to, the job's status, the Events and metric counts,
the pods to delete and the Workload writes. No client, no clock of its own, no I/O: tested as
tables of observed -> plan (tests/operator/reconcile/test_plan.py). operator/reconcile/apply.py carries it out.

`plan` reads top to bottom as a sequence of named decisions, each a sub-plan that returns what it
decided (a value, or a small frozen dataclass: `ThroughKueue`, `Failing`, `Slots`) from what was observed
and the decisions before it; none changes what it is handed. Each is tested on its own too.

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
from diloco.operator.reconcile import children, syncer_switch
from diloco.operator.reconcile.actions import Count, Event, PodDelete, WorkloadWrite
from diloco.operator.reconcile.observe import Observed, paired, syncer_ready, target
from diloco.operator.reconcile.regions import remote_regions
from diloco.operator.remote.health import Write
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
    let_go: tuple[dict[str, Any], ...] = ()  # finished Kueue Workloads whose integration finalizer comes off
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
    remote_writes: tuple[Write, ...] = ()  # a multi-cluster job's remote parts (operator/remote/)


@dataclass(frozen=True)
class Settled:
    """The status once the child writes' refusals are known, and what shows them."""

    status: dict[str, Any]
    patch: dict[str, Any]  # what changed: the status write (empty: none)
    events: tuple[Event | Count, ...]


@dataclass(frozen=True)
class ThroughKueue:
    """The job as this pass runs it once through Kueue, with the children the sync may touch;
    `queued`: Kueue's decision (operator/kueue/queueing.py), None for a job not queued."""

    job: DecoupledDiLoCoJob
    live: dict[children.Key, Any]
    queued: queueing.Queued | None = None

    @property
    def gate(self) -> kueue.Gate | None:
        return self.queued.gate if self.queued is not None else None

    @property
    def workloads(self) -> list[dict[str, Any]]:
        return self.queued.workloads if self.queued is not None else []

    @property
    def placed(self) -> dict[str, placement.PodSetInfo]:
        return self.queued.placed if self.queued is not None else {}


@dataclass(frozen=True)
class Failing:
    """The pods whose state is the job's (waiting for capacity: operator/failures/capacity.py, failing:
    operator/failures/policy.py), the failures counted, and a Warning Event for each new one."""

    mine: list[dict[str, Any]] = field(default_factory=list)
    counted: dict[str, Any] = field(default_factory=dict)  # the status patch: status.failures (empty: unchanged)
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class Slots:
    """What the learners' slots change in one pass: the status patch (lists: replaced whole), the
    Events and metric counts, and the pods to delete, in order."""

    patch: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event | Count, ...] = ()
    deletes: tuple[PodDelete, ...] = ()

    def __add__(self, then: Slots) -> Slots:
        """These, then `then` (decided on the status with these applied)."""
        return Slots({**self.patch, **then.patch}, self.events + then.events, self.deletes + then.deletes)


def plan(o: Observed, now: float) -> Plan:
    """The pass over `o`'s job at `now`: the sub-plans below, in turn, each deciding from what was
    observed and what those before it decided."""
    meta, old = o.body["metadata"], o.status
    generation = int(meta.get("generation") or 0)
    ref = n.job_reference(meta["name"], meta["namespace"], meta["uid"])
    if o.job is None:
        return invalid(o, ref, generation, now)
    was_finished, stamp = st.finished(old), st.rfc3339(now)
    link, blocker = link_and_blocker(o, o.job)
    through = through_kueue(o, o.job, link, finished=was_finished, generation=generation)
    job, q = through.job, through.queued
    failing = pod_failures(old, job, o.pods, finished=was_finished, now=now)
    obs = _observation(o, job, job_pods=o.pods, live=through.live, blocker=blocker, now=now, mine=failing.mine)
    counted = {**old, **failing.counted}
    ended = None if was_finished else st.ending(job.spec, counted, obs)
    computed = job_status(o, job, counted, obs, ended=ended, gate=through.gate, stamp=stamp, generation=generation)
    regions = remote_regions(o, computed, obs, stamp=stamp, generation=generation)
    computed = {**computed, **regions.patch}
    told = status_events(old, computed, gate=through.gate, refused=o.refused, ended=ended)
    desired = desired_children(o, job, link=link, blocker=blocker, new=computed, ended=ended,
                               placed=through.placed) + through.workloads
    pods_run = ended is None and not was_finished and blocker is None and not job.spec.suspend
    slots = learner_slots(job, computed, o.pods, ref, now=now, finished=set(obs.finished), gangs=pods_run)
    new = {**computed, **slots.patch}
    return Plan(ref, "ok", old, new, replace=q.replace if q else None, let_go=q.let_go if q else (),
                suspend=q.suspend if q else None,
                early=q.events if q else (), desired=desired, live=through.live,
                children=children.plan(desired, list(through.live.values()), o.owner.uid),
                pods=None if was_finished else o.pods,
                events=(*failing.events, *told, *regions.events, *slots.events, *blocker_events(old, blocker)),
                pod_deletes=(*force_deletes(o.pods, ref, now=now, timeout=o.config.stuck_timeout), *slots.deletes),
                workload_writes=workload_writes(q, new, o.pods, finished=was_finished, stamp=stamp), stamp=stamp,
                generation=generation, capacity_tokens=goodput.capacity_tokens(job.spec, new.get("accounting") or {}),
                waiting=_waiting(obs, now), delete_job=_expired(job, old, new, now), remote_writes=regions.writes)


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


# --- the sub-plans, in the order `plan` takes them ------------------------------------------------

def invalid(o: Observed, ref: dict[str, Any], generation: int, now: float) -> Plan:
    """A spec that cannot run here: the job Failed (InvalidSpec, told once it changes), no child touched."""
    new = st.invalid(o.status, o.problems, generation, now)
    told = (Event("InvalidSpec", "; ".join(o.problems), warning=True),) if st.changed(o.status, new) else ()
    return Plan(ref, "invalid", o.status, new, events=told, generation=generation)


def link_and_blocker(o: Observed, job: DecoupledDiLoCoJob) -> tuple[access.Link, access.Blocker | None]:
    """How the pods reach the syncer, and what keeps them from running: a Secret the job names
    missing or incomplete, or, for an external syncer asked before the learners are rendered, its refusal."""
    link = access.link(job, o.owner.namespace, o.secrets)
    return link, access.refused(job, link, o.syncer[1]) if o.probed else access.secret_blocker(job, o.secrets)


def through_kueue(o: Observed, job: DecoupledDiLoCoJob, link: access.Link, *, finished: bool,
                  generation: int) -> ThroughKueue:
    """A queued job's pass through Kueue (operator/kueue/queueing.py): the job as admitted, and the
    children without the Workloads the sync leaves alone this pass; a job not queued, as it is."""
    if o.queue is None:
        return ThroughKueue(job, dict(o.live))
    assert o.kueue is not None
    q = queueing.decide(job, o.kueue, owner=o.owner, link=link, queue_name=o.queue, live=dict(o.live),
                        finished=finished, generation=generation, stopped=lifecycle.stopped(o.pods))
    return ThroughKueue(q.job, {k: v for k, v in o.live.items() if k not in q.dropped}, q)


def pod_failures(status: dict[str, Any], job: DecoupledDiLoCoJob, job_pods: list[dict[str, Any]], *,
                 finished: bool, now: float) -> Failing:
    """The job's pods that count (none once it finished), the permanent failures among them
    folded into status.failures, and a Warning Event for each new one."""
    if finished:
        return Failing()
    mine = failures.counting(job_pods, lambda slot: st.slot_wanted(job.spec, slot))
    counted, fresh = failures.fold(status, mine, now)
    told = failures.events(status, fresh, job.spec.run_policy.backoff_limit)
    return Failing(mine, counted, tuple(Event(reason, message, warning=True) for reason, message in told))


def job_status(o: Observed, job: DecoupledDiLoCoJob, counted: dict[str, Any], obs: st.Observation, *,
               ended: st.Ending | None, gate: kueue.Gate | None, stamp: str, generation: int) -> dict[str, Any]:
    """The status computed from what was observed (operator/status/job.py; `counted`: the status
    read with the failures folded in), with the record of the spec's immutable fields and their
    condition (operator/admission/immutable.py), Kueue's JobAdmitted condition, and KueueDefaulted
    where Kueue's default integrations took the job's children (operator/kueue/integration.py)."""
    computed = st.compute(job.spec, counted, obs, generation=generation, ended=ended)
    recorded = immutable.condition(immutable.record(o.status, computed, o.owner.uid, job.spec), o.status,
                                   problems=o.refused, now=stamp, generation=generation)
    conds = kueue.condition(recorded["conditions"], gate, stamp, generation)
    taken = kueue.taken([*[x for k, x in o.live.items() if k[0] in kueue.TAKEN_KINDS], *o.pods])
    return {**recorded, "conditions": kueue.defaulted_condition(conds, taken, stamp, generation,
                                                                queued=o.queue is not None)}


def desired_children(o: Observed, job: DecoupledDiLoCoJob, *, link: access.Link, blocker: access.Blocker | None,
                     new: dict[str, Any], ended: st.Ending | None,
                     placed: dict[str, placement.PodSetInfo]) -> list[dict[str, Any]]:
    """The children to converge to (Kueue's Workloads aside), placed as Kueue admitted them: as
    the job runs, or, once it ends, what stays (spec.runPolicy.cleanPodPolicy names the pods that
    go; the checkpoint volume, config and token stay)."""
    config, status = o.config, o.status
    if ended is None:
        rendered = render.children(job, o.owner, o.token, started=st.started(status), finished=st.finished(status),
                                   blocked=blocker is not None, link=link, outcome=policies.outcome(status),
                                   expose_annotations=config.expose_annotations, peers=config.peers)
        rendered = syncer_switch.held_back(rendered, job, o.live, o.pods)  # a sharded standby added or removed
    else:
        rendered = render.children(job, o.owner, o.token, started=True, finished=True, link=link,
                                   outcome=policies.outcome(new), peers=config.peers)
    return placement.place(rendered, placed)


def learner_slots(job: DecoupledDiLoCoJob, status: dict[str, Any], job_pods: list[dict[str, Any]],
                  ref: dict[str, Any], *, now: float, finished: set[str], gangs: bool) -> Slots:
    """The one-host learners whose ready pod re-admits them, then (`gangs`: while the job runs its
    pods) every multi-host learner settled."""
    ready = readmit_ready(status, job_pods, ref)
    if not gangs:
        return ready
    return ready + settle_gangs(job, {**status, **ready.patch}, job_pods, ref, now=now, finished=finished)


def readmit_ready(status: dict[str, Any], job_pods: list[dict[str, Any]], ref: dict[str, Any]) -> Slots:
    """Lost one-host slots whose pod is ready but whose event was missed or came out of order,
    re-admitted (operator/failures/readmission.py; multi-host learners: `settle_gangs`)."""
    done = Slots()
    for pod in job_pods:
        found = n.learner_of(pod)
        if found is not None and not (pod["metadata"].get("labels") or {}).get(n.GANG):
            done += _readmitted(readmission.decide({**status, **done.patch}, ref, found[1], [pod]))
    return done


def settle_gangs(job: DecoupledDiLoCoJob, status: dict[str, Any], job_pods: list[dict[str, Any]],
                 ref: dict[str, Any], *, now: float, finished: set[str]) -> Slots:
    """Every multi-host learner settled (`settle_gang`) in turn, each on the status the ones before
    left; one that finished its steps is left alone: its hosts exit 0 one by one, which is no lost
    host (operator/status/steps.py)."""
    done = Slots()
    for group in job.spec.learner_groups:
        for i in range(group.replicas) if learners.is_gang(group) else ():
            learner = LearnerId(group.name, i)
            if str(learner) not in finished:
                done += settle_gang({**status, **done.patch}, ref, learner, group.hosts_per_learner, job_pods, now=now)
    return done


def settle_gang(status: dict[str, Any], ref: dict[str, Any], learner: LearnerId, hosts: int,
                job_pods: list[dict[str, Any]], *, now: float) -> Slots:
    """One multi-host learner: its run recorded, restarted as a whole if it lost a host
    (operator/failures/gang_plan.py), re-admitted once all its hosts are back (operator/failures/readmission.py)."""
    namespace, name = ref["metadata"]["namespace"], ref["metadata"]["name"]
    members = [p for p in job_pods if (p.get("metadata", {}).get("labels") or {}).get(n.GANG) ==
               n.gang(name, learner.group, learner.index)]
    step = gang_plan.settle(status, namespace=namespace, job=name, learner=learner, hosts=hosts, gang_pods=members,
                            now=now)
    restarted = Slots(step.patch, step.then, tuple(PodDelete(p["metadata"]["name"], p["metadata"].get("uid"))
                                                   for p in step.delete))
    return restarted + _readmitted(readmission.decide({**status, **step.patch}, ref, learner, members, hosts=hosts))


def _readmitted(back: readmission.Readmitted | None) -> Slots:
    return Slots() if back is None else Slots(back.patch, back.then)


def status_events(old: dict[str, Any], new: dict[str, Any], *, gate: kueue.Gate | None, refused: list[str],
                  ended: st.Ending | None) -> tuple[Event, ...]:
    """The status's news as Events, in order, each told once: Kueue's trouble (its default
    integrations taking the job's children among it), edits to immutable
    fields refused, the job's end, a pod waiting for capacity, a standby syncer's takeover, a sharded
    standby's change waiting for the old syncers to stop."""
    before = old.get("conditions") or []
    waiting = capacity.started_waiting(before, new["conditions"])
    took_over = st.takeover(old, new)
    told = (
        Event(gate.reason, gate.message, warning=True) if gate is not None and gate.reason in kueue.TROUBLE and
        (c.find(before, kueue.JOB_ADMITTED) or {}).get("reason") != gate.reason else None,
        Event(kueue.DEFAULTED, (c.find(new["conditions"], kueue.DEFAULTED) or {}).get("message", ""), warning=True)
        if c.find(new["conditions"], kueue.DEFAULTED) and not c.find(before, kueue.DEFAULTED) else None,
        Event("SpecImmutable", "; ".join(refused), warning=True) if immutable.newly_refused(old, refused) else None,
        Event(ended.reason, ended.message, warning=not ended.succeeded) if ended is not None else None,
        Event(capacity.WAITING, waiting["message"], warning=True) if waiting is not None else None,
        Event(*took_over, warning=True) if took_over is not None else None,
        Event(st.SYNCER_SWITCHING, (c.find(new["conditions"], c.RUNNING) or {}).get("message", ""))
        if _running_reason(new) == st.SYNCER_SWITCHING != _running_reason(old) else None,
    )
    return tuple(e for e in told if e is not None)


def blocker_events(old: dict[str, Any], blocker: access.Blocker | None) -> tuple[Event, ...]:
    """What keeps the pods from running, told when it becomes the Running condition's reason."""
    if blocker is None or _running_reason(old) == blocker.reason:
        return ()
    return (Event(blocker.reason, blocker.message, warning=True),)


def force_deletes(job_pods: list[dict[str, Any]], ref: dict[str, Any], *, now: float,
                  timeout: float) -> tuple[PodDelete, ...]:
    """The pods Terminating past their grace period by over `timeout` (a dead node's): they hold their
    slot, so they are deleted now, counted and told once deleted."""
    return tuple(_force_delete(pod, ref, timeout) for pod in pods.stuck(job_pods, now, timeout))


def workload_writes(q: queueing.Queued | None, new: dict[str, Any], job_pods: list[dict[str, Any]], *,
                    finished: bool, stamp: str) -> tuple[WorkloadWrite, ...]:
    """A queued job's Workload status: Finished once the job is (Kueue frees its quota), else what
    Kueue waits for from its pods (operator/kueue/queueing.py: `settle`)."""
    if q is None:
        return ()
    if q.current is not None and st.finished(new):
        done = lifecycle.finish(q.current, succeeded=c.is_true(new["conditions"], c.SUCCEEDED),
                                message="the job finished", now=stamp)
        return (WorkloadWrite(q.current, done),) if done is not None else ()
    return tuple(queueing.settle(q, job_pods, finished=finished, now=stamp))


def _observation(o: Observed, job: DecoupledDiLoCoJob, *, job_pods: list[dict[str, Any]],
                 live: dict[children.Key, Any], blocker: access.Blocker | None, now: float,
                 mine: list[dict[str, Any]]) -> st.Observation:
    owner = o.owner
    ready = {g.name: learners.ready_learners(g, job_pods) for g in job.spec.learner_groups}
    view, error = o.syncer
    # An external syncer was asked before the learners were rendered; the job's own, once ready.
    ready_syncer = view is not None if o.probed or paired(job) else syncer_ready(job, live)
    syncer_pods = [x for x in job_pods if (x["metadata"].get("labels") or {}).get(n.COMPONENT) == n.SYNCER]
    return st.Observation(
        now=now, ready=ready, syncer_endpoint=target(o.config, job, owner, o.secrets, o.token).address,
        syncer_ready=ready_syncer, syncer_restarts=pods.restarts(syncer_pods), syncer=view, syncer_error=error,
        exposed_address=",".join(exposure.addresses(job, live)), blocker=blocker,
        unschedulable=tuple(capacity.waiting(mine, now, o.config.gate_grace)),
        image_stuck=failures.image_stuck(mine, now, o.config.image_pull_grace), finished=steps.finished(job.spec, mine),
        syncer_switch=tuple(syncer_switch.waiting_for(job, live, job_pods)))


def _force_delete(pod: dict[str, Any], ref: dict[str, Any], timeout: float) -> PodDelete:
    """A pod Terminating past its grace period (a dead node's) holds its slot: deleted now."""
    meta, job = pod["metadata"], ref["metadata"]
    return PodDelete(meta["name"], meta.get("uid"), grace_seconds=0, then=(
        Count("forced_deletions", (job["namespace"], job["name"])),
        Event("PodForceDeleted", f"pod {meta['name']} was Terminating past its grace period by over {timeout:.0f} s",
              warning=True)))


def _running_reason(status: dict[str, Any]) -> str:
    return str((c.find(status.get("conditions") or [], c.RUNNING) or {}).get("reason", ""))


def _waiting(obs: st.Observation, now: float) -> tuple[int, float]:
    """Pods waiting for capacity, and the longest wait in seconds."""
    return len(obs.unschedulable), obs.unschedulable[0].seconds(now) if obs.unschedulable else 0.0


def _expired(job: DecoupledDiLoCoJob, status: dict[str, Any], new: dict[str, Any], now: float) -> Event | None:
    """A finished job past spec.runPolicy.ttlSecondsAfterFinished: deleted, with this Event."""
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    done_at = st.parse_time(new.get("completionTime") or status.get("completionTime"))
    if ttl is None or done_at is None or now - done_at < ttl:
        return None
    return Event("TTLExpired", f"finished {now - done_at:.0f} s ago; deleting (ttlSecondsAfterFinished={ttl})")
