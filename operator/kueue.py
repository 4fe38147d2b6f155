"""Kueue for DecoupledDiLoCoJobs: the operator is the job integration.

Kueue admits Workloads, not jobs: for its built-in kinds (Job, JobSet, ...) an integration
creates a Workload per job and then starts or stops the job as Kueue decides. Nothing does that
for this CRD, so the operator does it for jobs labelled `kueue.x-k8s.io/queue-name` (only when
the chart's `kueue.enabled` turns it on: Config.kueue). The Workload, `diloco-<job>-<uid hash>`
owned by the job, has one PodSet per learner group (replicas x hostsPerLearner pods, the group's
learner pod template: resources, nodeSelector, tolerations) and one for the syncer (one pod per
shard; none in a learners-only cluster), so Kueue reserves quota for the whole job at once.

Why the operator writes `spec.suspend` (as Kueue's own job reconciler does) rather than holding
the pods back in rendering: `spec.suspend` is already what every part of the operator reads (what
is rendered, the status, the phase, the immutable-field rules a queued job may still be edited
under), and it is what a Kueue user reads too: a queued job is `suspend: true` until admitted, an
admitted one `false`, an evicted one (preempted, deactivated) `true` again, and its pods go. So
for a queued job Kueue owns `spec.suspend`: the operator sets it from the Workload on every pass,
and stopping a queued job by hand is Kueue's way, `spec.active: false` on its Workload. The job's
`Admitted` condition says which it is, naming the Workload and the queue.

A Workload's PodSets cannot change once it holds quota: when the learner groups or their
replicas change, the held Workload is replaced by a new one (the job is suspended until Kueue
admits that), as Kueue does for its own jobs. A finished job's Workload gets `Finished`, which
frees its quota. Pure, except `finish` (one status write).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.operator import access, drift, learners, render
from diloco.operator import conditions as c
from diloco.operator import naming as n
from diloco.operator.kube import ApiError, Kube
from diloco.operator.parts import Owner, meta
from diloco.spec import DecoupledDiLoCoJob

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
API_VERSION, KIND = "kueue.x-k8s.io/v1beta1", "Workload"
MAX_POD_SETS = 8  # Kueue's limit on spec.podSets
MAX_NAME = 63  # a Workload's and a PodSet's name: a DNS label
SYNCER_POD_SET = n.SYNCER
# Workload conditions (kueue apis/kueue/v1beta1/workload_types.go).
ADMITTED, QUOTA_RESERVED, EVICTED, FINISHED = "Admitted", "QuotaReserved", "Evicted", "Finished"
# The job's condition: Kueue's word for it.
JOB_ADMITTED = "Admitted"


def queue(config_kueue: bool, labels: Mapping[str, str] | None) -> str | None:
    """The LocalQueue a job is queued in: its label, when this operator integrates with Kueue."""
    return ((labels or {}).get(QUEUE_LABEL) or None) if config_kueue else None


def workload_name(job: str, uid: str) -> str:
    """Like Kueue's names for its jobs' Workloads: the uid's hash, so a job re-created under the
    same name never inherits the old one's admission while the garbage collector catches up."""
    return f"diloco-{job}-{hashlib.sha256(uid.encode()).hexdigest()[:5]}"[:MAX_NAME]


def problems(job: DecoupledDiLoCoJob) -> list[str]:
    """What Kueue would refuse: more PodSets than it allows, or a group the syncer's PodSet shadows."""
    out: list[str] = []
    groups = job.spec.learner_groups
    syncer = job.spec.syncer.external is None
    if len(groups) + syncer > MAX_POD_SETS:
        out.append(f"spec.learnerGroups: a Kueue Workload holds at most {MAX_POD_SETS} PodSets, one per learner "
                   f"group{' plus the syncer' if syncer else ''}; this job has {len(groups)} groups (at most "
                   f"{MAX_POD_SETS - syncer}), or remove the {QUEUE_LABEL} label")
    for i, g in enumerate(groups):
        if syncer and g.name == SYNCER_POD_SET:
            out.append(f"spec.learnerGroups[{i}].name: {g.name!r} is the syncer's PodSet in the job's Kueue "
                       f"Workload; rename the group")
    return out


def _template(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template without its config-hash annotation: a training setting changed on an admitted
    job must not re-queue it (a changed PodSet replaces the Workload), only what Kueue reads."""
    return {**template, "metadata": {"labels": template["metadata"]["labels"]}}


def pod_sets(job: DecoupledDiLoCoJob, owner: Owner, link: access.Link | None = None) -> list[dict[str, Any]]:
    """One PodSet per learner group, then the syncer's: what Kueue reserves quota for."""
    link = link or access.link(job, owner.namespace, {})
    out = []
    for g in job.spec.learner_groups:
        # A multi-host learner's gangs differ only in their index: any one stands for all.
        template = learners.pod_template(job, owner, g, link, 0 if learners.is_gang(g) else None)
        out.append({"name": g.name, "count": g.replicas * g.hosts_per_learner, "template": _template(template)})
    if job.spec.syncer.external is None:
        out.append({"name": SYNCER_POD_SET, "count": job.spec.syncer.shards,
                    "template": _template(render.syncer_pod_template(job, owner))})
    return out


def workload(job: DecoupledDiLoCoJob, owner: Owner, queue_name: str,
             link: access.Link | None = None) -> dict[str, Any]:
    """The job's Workload (spec only: its status is Kueue's)."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": meta(owner, workload_name(owner.name, owner.uid)),
            "spec": {"queueName": queue_name, "podSets": pod_sets(job, owner, link)}}


def _true(wl: Mapping[str, Any] | None, type_: str) -> bool:
    return c.is_true(list(((wl or {}).get("status") or {}).get("conditions") or []), type_)


def admitted(wl: Mapping[str, Any] | None) -> bool:
    """Kueue admitted it: quota reserved and every admission check passed (v1beta1's Admitted)."""
    return _true(wl, ADMITTED)


def evicted(wl: Mapping[str, Any] | None) -> bool:
    """Kueue took the admission back (preempted, deactivated, ...): the job must stop."""
    return _true(wl, EVICTED)


def finished(wl: Mapping[str, Any] | None) -> bool:
    return _true(wl, FINISHED)


def holds_quota(wl: Mapping[str, Any] | None) -> bool:
    return _true(wl, QUOTA_RESERVED) or bool(((wl or {}).get("status") or {}).get("admission"))


def deleting(wl: Mapping[str, Any] | None) -> bool:
    return bool(((wl or {}).get("metadata") or {}).get("deletionTimestamp"))


def stale(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """A held Workload whose PodSets or queue no longer match the job: Kueue refuses changing
    them, so it is replaced (deleted, then created afresh and queued again)."""
    return live is not None and holds_quota(live) and not drift.contains(live.get("spec"), desired["spec"])


@dataclass(frozen=True)
class Gate:
    """What a queued job's spec.suspend must be, and its Admitted condition."""

    suspend: bool
    admitted: bool
    reason: str
    message: str


def gate(live: Mapping[str, Any] | None, name: str, queue_name: str) -> Gate:
    """Run only while Kueue admits the Workload and has not evicted it (one being deleted, being
    replaced, admits nothing)."""
    where = f"Workload {name} in LocalQueue {queue_name}"
    if deleting(live):
        live = None
    if evicted(live):
        cond = c.find(list(((live or {}).get("status") or {}).get("conditions") or []), EVICTED) or {}
        why = f"{cond.get('reason', 'Evicted')}: {cond.get('message', '')}".rstrip(": ")
        return Gate(True, False, "Evicted", f"Kueue evicted {where} ({why}); suspended until it is admitted again")
    if admitted(live):
        cq = (((live or {}).get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        return Gate(False, True, "Admitted", f"Kueue admitted {where}" + (f" to ClusterQueue {cq}" if cq else ""))
    return Gate(True, False, "WaitingForAdmission", f"suspended until Kueue admits {where}")


def condition(conds: list[dict[str, Any]], g: Gate | None, now: str, generation: int) -> list[dict[str, Any]]:
    """The job's Admitted condition; gone when the job is not queued (any more)."""
    if g is None:
        return [x for x in conds if x.get("type") != JOB_ADMITTED]
    return c.set_condition(conds, JOB_ADMITTED, g.admitted, g.reason, g.message, now, generation)


def finish(kube: Kube, live: Mapping[str, Any], succeeded: bool, message: str, now: str) -> None:
    """Mark a finished job's Workload Finished (Kueue then frees its quota). The other
    conditions are Kueue's: the list is written whole, guarded by its resourceVersion, and a
    conflict waits for the next pass."""
    if finished(live):
        return
    md = live["metadata"]
    conds = c.set_condition(list((live.get("status") or {}).get("conditions") or []), FINISHED, True,
                            "Succeeded" if succeeded else "Failed", message, now, int(md.get("generation") or 0))
    try:
        kube.patch(KIND, md["namespace"], md["name"],
                   {"metadata": {"resourceVersion": md.get("resourceVersion")}, "status": {"conditions": conds}},
                   sub="status")
    except ApiError as exc:
        if exc.status not in (404, 409):
            raise
