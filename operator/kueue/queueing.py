"""A queued job's pass through Kueue, in the reconcile's three steps: `read` what Kueue's part
needs (the API version served, the priority class, the admitted flavors), `decide` purely, and
the writes go out with the rest of the pass (operator/reconcile/apply.py).

`decide` runs before the children are rendered: the job's Workload(s) in the Kueue version the
cluster serves (operator/kueue/integration.py; slices for an elastic job, operator/kueue/slices.py), spec.suspend from the
admission, and the job as this pass runs it (the learners Kueue admitted). `settle` runs on the
job's pods: the reservation given back after an eviction, once the pods are gone, and PodsReady
(operator/kueue/lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.operator.kube import ApiError, Kube
from diloco.operator.kueue import api as kueue_api
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import lifecycle, placement, priorities, slices
from diloco.operator.reconcile import children
from diloco.operator.reconcile.actions import Event, WorkloadWrite
from diloco.operator.render import access
from diloco.operator.render import job as render
from diloco.spec import DecoupledDiLoCoJob

REPLACING = "Replacing"  # the job's Admitted reason while its pods stop before its Workload is replaced


@dataclass(frozen=True)
class Seen:
    """What a queued job's pass read of Kueue besides the job's own Workloads (in `live`)."""

    version: str | None  # the Workload API version served; None: Kueue is not served
    not_served: str = ""  # the API server's word for that
    priority: priorities.Priority | None = None
    missing: str = ""  # why the priority class the job names has no value ("" when it names none)
    flavors: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # the admission's, by name
    unreadable: list[str] = field(default_factory=list)  # flavors the operator may not read


@dataclass(frozen=True)
class Queued:
    """What this pass does with a queued job."""

    job: DecoupledDiLoCoJob  # as it runs now: spec.suspend from the gate, replicas as admitted
    gate: kueue.Gate
    workloads: list[dict[str, Any]] = field(default_factory=list)  # to apply
    placed: dict[str, placement.PodSetInfo] = field(default_factory=dict)  # what the admission puts into pods
    current: dict[str, Any] | None = None  # the live Workload the job follows: held, else waiting
    admitted: dict[str, int] = field(default_factory=dict)  # pods each PodSet may run
    suspend: bool | None = None  # spec.suspend to write (None: as it is)
    replace: dict[str, Any] | None = None  # the held Workload to delete: it is for an older shape of the job
    let_go: tuple[dict[str, Any], ...] = ()  # finished Workloads whose finalizer comes off
    dropped: tuple[children.Key, ...] = ()  # the job's Workloads the children's sync leaves alone this pass
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class _Shape:
    desired: dict[str, Any]
    slices: slices.Slices
    current: dict[str, Any] | None
    rendered: list[dict[str, Any]]
    replace: dict[str, Any] | None
    dropped: tuple[children.Key, ...]
    replacing: dict[str, Any] | None = None  # the held Workload to replace once the job's pods are gone


def _shape(job: DecoupledDiLoCoJob, seen: Seen, *, owner: render.Owner, link: access.Link, queue_name: str,
           live: dict[children.Key, Any], generation: int, finished: bool = False, stopped: bool = False) -> _Shape:
    """The job's Workloads: the one it follows, those to apply, and the held one replaced if it
    is for an older shape of the job (`stopped`: none of the job's pods is left, so it may go)."""
    assert seen.version is not None
    desired = kueue.workload(job, owner, queue_name, link, version=seen.version, priority=seen.priority)
    keys = [k for k in live if k[0] == kueue.KIND]
    whole = kueue.whole(job)
    plan = slices.plan(desired, [live[k] for k in keys], generation=generation, whole=whole)
    if seen.missing:
        # As Kueue's integrations: no Workload (or no change to those there) until the class exists.
        return _Shape(desired, plan, plan.held or plan.waiting, [], None, tuple(keys))
    held = plan.held
    if held is not None and (kueue.deleting(held) or slices.stale(held, desired, whole=whole,
                                                                  elastic=kueue.elastic(job))):
        # The new one once the old one is gone. Its quota goes with it, so not while the job's
        # pods still run (the job is suspended first): Kueue's jobframework stops the job, then
        # deletes a Workload that no longer matches it (reconciler.go, ensureOneWorkload).
        if not stopped:
            return _Shape(desired, plan, None, [], None, (children.key(held),), replacing=held)
        return _Shape(desired, plan, None, [], held, (children.key(held),))
    if finished:  # a finished job queues nothing and keeps what it has, its finalizers let go (`let_go`);
        # a slice still queued to grow it is deleted: Kueue would otherwise admit it, quota for nothing.
        waiting = plan.waiting
        grow = children.key(waiting) if waiting is not None and slices.sliced(waiting) else None
        return _Shape(desired, plan, plan.held or plan.waiting, [], None, tuple(k for k in keys if k != grow))
    return _Shape(desired, plan, plan.held or plan.waiting, plan.workloads, None, ())


def let_go(live: dict[children.Key, Any], *, finished: bool) -> tuple[dict[str, Any], ...]:
    """A finished job's Workloads that Kueue finished and still carry the integration's
    finalizer: Kueue's jobframework takes it off then (reconciler.go, `workload.RemoveFinalizer`
    once IsFinished). Those of a running job that are finished (a replaced slice) are deleted,
    finalizer first (operator/reconcile/children.py)."""
    if not finished:
        return ()
    return tuple(w for k, w in sorted(live.items()) if k[0] == kueue.KIND and kueue.finished(w)
                 and kueue.FINALIZER in (w["metadata"].get("finalizers") or []))


def read(api: Kube, job: DecoupledDiLoCoJob, *, owner: render.Owner, link: access.Link, queue_name: str,
         live: dict[children.Key, Any], generation: int) -> Seen:
    """The observe step for a queued job: the version served, the priority class, and the
    ResourceFlavors of the Workload it follows once that is admitted."""
    try:
        version = api.served_version(kueue.KUEUE_GROUP)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return Seen(None, exc.detail)
    priority, missing = kueue_api.lookup_priority(api, job)
    seen = Seen(version, priority=priority, missing=missing)
    current = _shape(job, seen, owner=owner, link=link, queue_name=queue_name, live=live,
                     generation=generation).current
    if current is None or not kueue.gate(current, "", queue_name).admitted:
        return seen
    flavors, unreadable = kueue_api.lookup_flavors(api, current)
    return Seen(version, priority=priority, missing=missing, flavors=flavors, unreadable=unreadable)


def decide(job: DecoupledDiLoCoJob, seen: Seen, *, owner: render.Owner, link: access.Link, queue_name: str,
           live: dict[children.Key, Any], finished: bool, generation: int, stopped: bool) -> Queued:
    """Pure: the job's Workloads (replaced if the one holding quota is for an older shape of the
    job), spec.suspend set from the admission, the learners it was given, and what the admission
    puts into its pods."""
    where = f"Workload {kueue.workload_name(owner.name, owner.uid)} in LocalQueue {queue_name}"
    if seen.version is None:
        gate = kueue.Gate(True, False, "KueueNotServed", f"suspended: {where} cannot be written, {seen.not_served}")
        return _suspend(Queued(job, gate), finished=finished)
    shape = _shape(job, seen, owner=owner, link=link, queue_name=queue_name, live=live, generation=generation,
                   finished=finished, stopped=stopped)
    current, plan = shape.current, shape.slices
    events: tuple[Event, ...] = ()
    if shape.replace is not None:
        events = (Event("WorkloadReplaced", f"the learner groups changed: Workload "
                                            f"{shape.replace['metadata']['name']} is queued again"),)
    name = current["metadata"]["name"] if current is not None else shape.desired["metadata"]["name"]
    gate = kueue.gate(current, name, queue_name)
    if shape.replacing is not None:
        gate = kueue.Gate(True, False, REPLACING, f"the job changed in a way Kueue does not allow on Workload "
                                                  f"{shape.replacing['metadata']['name']}, which holds its quota: "
                                                  "its pods are stopped, then the Workload is replaced and queued "
                                                  "again")
    if seen.missing and current is None:
        gate = kueue.Gate(True, False, "PriorityClassNotFound",
                          f"suspended: {where} is not written while {seen.missing}")
    placed: dict[str, placement.PodSetInfo] = {}
    if gate.admitted and current is not None:
        placed, problems = placement.placement(current, seen.flavors)
        problems = [*seen.unreadable, *problems, *placement.clashes(placed, shape.desired["spec"]["podSets"])]
        if problems:
            placed = {}
            gate = kueue.Gate(True, False, "PlacementFailed", f"Kueue admitted {where}, but its admission cannot be "
                                                              f"applied to the pods: {'; '.join(problems)}")
        else:
            gate = _partial(gate, job, plan)
    admitted = plan.admitted if gate.admitted else {}
    running = slices.running(job, admitted)
    return _suspend(Queued(running, gate, shape.rendered, placed, current, admitted, replace=shape.replace,
                           let_go=let_go(live, finished=finished), dropped=shape.dropped, events=events),
                    finished=finished)


def _partial(gate: kueue.Gate, job: DecoupledDiLoCoJob, plan: slices.Slices) -> kueue.Gate:
    """An admitted gate's message with the learners each group was given, where fewer than asked."""
    short = [f"{g.name} {plan.admitted.get(g.name, 0)} of {g.replicas}" for g in job.spec.learner_groups
             if plan.admitted.get(g.name, g.replicas) < g.replicas]
    if not short:
        return gate
    rest = f"; Workload {plan.workloads[-1]['metadata']['name']} is queued for the rest" \
        if len(plan.workloads) > 1 else ""
    return kueue.Gate(gate.suspend, gate.admitted, gate.reason,
                      f"{gate.message}, in part: learners {', '.join(short)}{rest}")


def _suspend(q: Queued, *, finished: bool) -> Queued:
    """spec.suspend as the gate says (Kueue owns it for a queued job), with an Event when it flips."""
    job, gate = q.job, q.gate
    if finished or gate.suspend == job.spec.suspend:
        return q
    events = q.events
    if gate.reason not in kueue.TROUBLE:  # those get theirs when the condition turns to them
        events += (Event(gate.reason, gate.message, warning=gate.reason == "Evicted"),)
    running = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": gate.suspend})})
    return Queued(running, gate, q.workloads, q.placed, q.current, q.admitted, suspend=gate.suspend,
                  replace=q.replace, let_go=q.let_go, dropped=q.dropped, events=events)


def settle(queued: Queued, job_pods: list[dict[str, Any]], *, finished: bool, now: str) -> list[WorkloadWrite]:
    """Pure: the Workload status Kueue waits for from the integration: an evicted job's
    reservation given back once its pods are gone (with an Event), and PodsReady (operator/kueue/lifecycle.py)."""
    wl = queued.current
    if wl is None or finished or kueue.finished(wl) or kueue.deleting(wl):
        return []
    # PodsReady first, evicted or not, as Kueue's jobframework writes it before it handles an
    # eviction (reconciler.go, ReconcileGenericJob: step 5 before step 6): while the Workload is
    # still admitted it follows the pods (WaitForRecovery as they go); once the quota is given back
    # it is not admitted, so False/WaitForStart (generatePodsReadyCondition), and a job admitted
    # again starts from WaitForStart, which waitForPodsReady.timeout times, not from WaitForRecovery.
    counts = queued.admitted if not kueue.evicted(wl) else slices.given(wl)
    ready = lifecycle.all_ready(kueue.must_be_ready(queued.job, counts), job_pods)
    status = lifecycle.pods_ready(wl, ready, now)
    if not kueue.evicted(wl) or not lifecycle.stopped(job_pods):
        return [WorkloadWrite(wl, status)] if status is not None else []
    after = {**wl, "status": {**(wl.get("status") or {}), **(status or {})}}
    released = lifecycle.release(after, now)
    if released is None:
        return [WorkloadWrite(wl, status)] if status is not None else []
    after = {**after, "status": {**after["status"], **released}}
    again_ready = lifecycle.pods_ready(after, False, now)
    final = {**released, **(again_ready or {})}
    reason, message = lifecycle.evicted_reason(wl)
    again = "Kueue queues it again" if reason in lifecycle.REQUEUED_BY_KUEUE else \
        "it is queued again when Kueue allows"
    return [WorkloadWrite(wl, final, Event(
        "QuotaReleased", f"Workload {wl['metadata']['name']} was evicted ({reason}: {message}); its pods are "
                         f"gone, so its quota is given back and {again}"))]
