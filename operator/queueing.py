"""A queued job's pass through Kueue: its Workloads, what it may run, and the status Kueue awaits.

`queue` runs before the children are rendered: the job's Workload(s) in the Kueue version the
cluster serves (kueue.py; slices for an elastic job, kueue_slices.py), spec.suspend from the
admission, and the job as this pass runs it (the learners Kueue admitted). `settle` runs once the
job's pods are read: the reservation given back after an eviction, once the pods are gone, and
PodsReady (kueue_lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.operator import access, children, kueue, kueue_io, kueue_lifecycle, kueue_placement, kueue_slices, render
from diloco.operator.context import Context, post
from diloco.operator.kube import ApiError
from diloco.spec import KIND, DecoupledDiLoCoJob


@dataclass(frozen=True)
class Queued:
    """What this pass does with a queued job."""

    job: DecoupledDiLoCoJob  # as it runs now: spec.suspend from the gate, replicas as admitted
    gate: kueue.Gate
    workloads: list[dict[str, Any]] = field(default_factory=list)  # to apply
    placed: dict[str, kueue_placement.PodSetInfo] = field(default_factory=dict)  # what the admission puts into the pods
    current: dict[str, Any] | None = None  # the live Workload the job follows: held, else waiting
    admitted: dict[str, int] = field(default_factory=dict)  # pods each PodSet may run


def queue(ctx: Context, ref: dict[str, Any], job: DecoupledDiLoCoJob, *, owner: render.Owner, link: access.Link,
          queue_name: str, live: dict[children.Key, Any], finished: bool, generation: int) -> Queued:
    """The job's Workloads (replaced if the one holding quota is for an older shape of the job),
    spec.suspend set from the admission, the learners it was given, and what the admission puts
    into its pods."""
    where = f"Workload {kueue.workload_name(owner.name, owner.uid)} in LocalQueue {queue_name}"
    try:
        version = ctx.api.served_version(kueue.KUEUE_GROUP)
    except ApiError as exc:
        if exc.status != 404:
            raise
        gate = kueue.Gate(True, False, "KueueNotServed", f"suspended: {where} cannot be written, {exc.detail}")
        return Queued(_suspend(ctx, ref, job, owner=owner, gate=gate, finished=finished), gate)
    priority, missing = kueue_io.lookup_priority(ctx.api, job)
    desired = kueue.workload(job, owner, queue_name, link, version=version, priority=priority)
    keys = [k for k in live if k[0] == kueue.KIND]
    plan = kueue_slices.plan(desired, [live[k] for k in keys], generation=generation)
    current, rendered = plan.held or plan.waiting, plan.workloads
    if missing:
        # As Kueue's integrations: no Workload (or no change to those there) until the class exists.
        for k in keys:
            live.pop(k)
        rendered = []
    elif plan.held is not None and (kueue.deleting(plan.held) or kueue_slices.stale(plan.held, desired)):
        held = children.key(plan.held)
        ctx.api.delete(held[0], owner.namespace, held[1], uid=plan.held["metadata"].get("uid"))
        post(ref, "WorkloadReplaced", f"the learner groups changed: Workload {held[1]} is queued again")
        live.pop(held)  # the new one once the old one is gone (Kueue's finalizer frees its quota first)
        current, rendered = None, []
    name = current["metadata"]["name"] if current is not None else desired["metadata"]["name"]
    gate = kueue.gate(current, name, queue_name)
    if missing and current is None:
        gate = kueue.Gate(True, False, "PriorityClassNotFound", f"suspended: {where} is not written while {missing}")
    placed: dict[str, kueue_placement.PodSetInfo] = {}
    if gate.admitted and current is not None:
        flavors, unreadable = kueue_io.lookup_flavors(ctx.api, current)
        placed, problems = kueue_placement.placement(current, flavors)
        problems = [*unreadable, *problems, *kueue_placement.clashes(placed, desired["spec"]["podSets"])]
        if problems:
            placed = {}
            gate = kueue.Gate(True, False, "PlacementFailed", f"Kueue admitted {where}, but its admission cannot be "
                                                              f"applied to the pods: {'; '.join(problems)}")
        else:
            gate = _partial(gate, job, plan)
    admitted = plan.admitted if gate.admitted else {}
    running = kueue_slices.running(job, admitted)
    return Queued(_suspend(ctx, ref, running, owner=owner, gate=gate, finished=finished), gate, rendered, placed,
                  current, admitted)


def _partial(gate: kueue.Gate, job: DecoupledDiLoCoJob, plan: kueue_slices.Slices) -> kueue.Gate:
    """An admitted gate's message with the learners each group was given, where fewer than asked."""
    short = [f"{g.name} {plan.admitted.get(g.name, 0)} of {g.replicas}" for g in job.spec.learner_groups
             if plan.admitted.get(g.name, g.replicas) < g.replicas]
    if not short:
        return gate
    rest = f"; Workload {plan.workloads[-1]['metadata']['name']} is queued for the rest" \
        if len(plan.workloads) > 1 else ""
    return kueue.Gate(gate.suspend, gate.admitted, gate.reason,
                      f"{gate.message}, in part: learners {', '.join(short)}{rest}")


def _suspend(ctx: Context, ref: dict[str, Any], job: DecoupledDiLoCoJob, *, owner: render.Owner, gate: kueue.Gate,
             finished: bool) -> DecoupledDiLoCoJob:
    """spec.suspend as the gate says (Kueue owns it for a queued job), with an Event when it flips."""
    if finished or gate.suspend == job.spec.suspend:
        return job
    ctx.api.patch(KIND, owner.namespace, owner.name, {"spec": {"suspend": gate.suspend}})
    if gate.reason not in kueue.TROUBLE:  # those get theirs when the condition turns to them
        post(ref, gate.reason, gate.message, warning=gate.reason == "Evicted")
    return job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": gate.suspend})})


def settle(ctx: Context, ref: dict[str, Any], queued: Queued, job_pods: list[dict[str, Any]], *, finished: bool,
           now: str) -> None:
    """The Workload status Kueue waits for from the integration: an evicted job's reservation
    given back once its pods are gone (with an Event), and PodsReady (kueue_lifecycle.py)."""
    wl = queued.current
    if wl is None or finished or kueue.finished(wl) or kueue.deleting(wl):
        return
    if kueue.evicted(wl):
        status = kueue_lifecycle.release(wl, now) if kueue_lifecycle.stopped(job_pods) else None
        if status is not None and kueue_io.write(ctx.api, wl, status):
            reason, message = kueue_lifecycle.evicted_reason(wl)
            again = "Kueue queues it again" if reason in kueue_lifecycle.REQUEUED_BY_KUEUE else \
                "it is queued again when Kueue allows"
            post(ref, "QuotaReleased", f"Workload {wl['metadata']['name']} was evicted ({reason}: {message}); its "
                                       f"pods are gone, so its quota is given back and {again}")
        return
    status = kueue_lifecycle.pods_ready(wl, kueue_lifecycle.all_ready(queued.admitted, job_pods), now)
    if status is not None:
        kueue_io.write(ctx.api, wl, status)
