"""Kueue for DecoupledDiLoCoJobs: the operator is the job integration.

Kueue admits Workloads, not jobs: for its built-in kinds (Job, JobSet, ...) an integration
creates a Workload per job and then starts or stops the job as Kueue decides. Nothing does that
for this CRD, so the operator does it for jobs labelled `kueue.x-k8s.io/queue-name` (only when
the chart's `kueue.enabled` turns it on: Config.kueue). The Workload, `diloco-<job>-<uid hash>`
owned by the job, has one PodSet per learner group (replicas x hostsPerLearner pods, the group's
learner pod template: resources, nodeSelector, tolerations) and one for the syncer (one pod per
shard, two with a standby; none in a learners-only cluster), so Kueue reserves quota for the
whole job at once.

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
frees its quota.

Which Kueue: the Workload is written in the newest version the cluster serves of those the
operator speaks (v1beta2, then v1beta1; kube.Kube.served_version), and the two differ, for what
the operator writes, only in how the priority class is named (v1beta1: priorityClassName and
priorityClassSource; v1beta2: priorityClassRef with group, kind and name). What the operator does
besides, as Kueue's own job integrations (its JobFramework) do for theirs:
- priority: the job's `kueue.x-k8s.io/priority-class` label names a WorkloadPriorityClass, else
  the first pod template's priorityClassName a PriorityClass; its value goes into spec.priority;
- topology-aware scheduling: Kueue's podset annotations (`kueue.x-k8s.io/podset-required-topology`
  and the others in topology.ANNOTATIONS), on a group's or the syncer's pod template or, for every
  learner group, on the job itself, become the PodSet's topologyRequest (a group's pods indexed by
  their StatefulSet ordinal, a multi-host group's learners as sub-groups);
- admission: the flavors Kueue assigned each PodSet (status.admission.podSetAssignments[].flavors)
  are read, and each ResourceFlavor's nodeLabels go into that PodSet's pods' nodeSelector and its
  tolerations into theirs, with the admission checks' podSetUpdates and, for a topology
  assignment, Kueue's scheduling gate; a clash (a node label the pods already select otherwise)
  keeps the job suspended, as Kueue keeps its own jobs.
Pure: the priority is operator/kueue/priorities.py, the topology annotations
operator/kueue/topology.py, what the admission puts into the pods operator/kueue/placement.py;
the reads of the cluster-scoped objects above and the Finished write are operator/kueue/api.py.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.operator.kube import KUEUE_GROUP, KUEUE_VERSIONS
from diloco.operator.kueue import topology
from diloco.operator.kueue.priorities import Priority, priority_fields
from diloco.operator.reconcile import drift
from diloco.operator.render import access, learners
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.operator.render.parts import Owner, meta
from diloco.operator.status import conditions as c
from diloco.spec import DecoupledDiLoCoJob

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KIND = "Workload"
NEWEST = KUEUE_VERSIONS[0]
# What Kueue's integrations put on an admitted job's pods: the PodSet's name, and with a
# topology assignment a scheduling gate its TopologyUngater lifts, and the Workload's name.
POD_SET_LABEL, WORKLOAD_ANNOTATION, TOPOLOGY_GATE = "kueue.x-k8s.io/podset", "kueue.x-k8s.io/workload", \
    "kueue.x-k8s.io/topology"
# A Workload that may grow and shrink while it holds quota (Kueue's workload slices, operator/kueue/slices.py):
# only the slices the operator queues to grow a job carry it, never a PodSet's minCount beside it.
ELASTIC = "kueue.x-k8s.io/elastic-job"
# What Kueue's job integrations put on the Workloads they create (pkg/controller/jobframework/utils.go,
# NewWorkload; reconciler.go, ConstructWorkload): the finalizer that keeps a Workload, and so its
# quota, until the integration lets it go (its job finished or gone, its pods stopped), and the
# job's uid as a label (Kueue finishes a Workload whose job is gone by it: FinishOrphanedWorkloads).
FINALIZER = "kueue.x-k8s.io/resource-in-use"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
_LABEL_VALUE = re.compile(r"(?=.{0,63}$)([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
# The resource name Kueue keeps for itself (it counts a PodSet's pods under it): a container
# asking for it is refused by Kueue's webhook (workload_webhook.go, validateResourceList).
RESERVED_RESOURCE = "pods"
MAX_POD_SETS = 8  # Kueue's limit on spec.podSets
MAX_NAME = 63  # a Workload's and a PodSet's name: a DNS label
SYNCER_POD_SET = n.SYNCER
# Workload conditions (kueue apis/kueue/v1beta1 and v1beta2 workload_types.go: the same).
ADMITTED, QUOTA_RESERVED, EVICTED, FINISHED = "Admitted", "QuotaReserved", "Evicted", "Finished"
# The job's condition: Kueue's word for it; its reasons for a job Kueue cannot run yet (each
# with a Warning Event when the condition turns to it).
JOB_ADMITTED = "Admitted"
TROUBLE = frozenset({"KueueNotServed", "PriorityClassNotFound", "PlacementFailed"})


# Kueue's default integrations (its shipped config enables pod, deployment and statefulset) label
# a StatefulSet or Deployment `kueue.x-k8s.io/queue-name: default` when its namespace has a
# LocalQueue named `default` and its owner's kind is not one Kueue knows (jobframework/defaults.go,
# ApplyDefaultLocalQueue; the pod integration likewise a pod with no Kueue-managed ancestor), and then
# makes a Workload of their own for them. The operator never sets the label on its children, so
# one that carries it was taken: condition DEFAULTED says so, naming the setting that keeps Kueue
# off them, the job's kind in Kueue's integrations.externalFrameworks.
DEFAULTED = "KueueDefaulted"
EXTERNAL_FRAMEWORK = "DecoupledDiLoCoJob.v1alpha1.diloco.dev"  # Kind.version.group, as externalFrameworks lists it
TAKEN_KINDS = ("StatefulSet", "Deployment", "Pod")


def taken(children: list[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(kind, name, LocalQueue) of the job's StatefulSets, Deployments and pods that carry Kueue's
    queue label, which only Kueue's defaulting puts there."""
    out = []
    for obj in children:
        meta = obj.get("metadata") or {}
        found = (meta.get("labels") or {}).get(QUEUE_LABEL)
        kind = obj.get("kind") or "Pod"
        if found and kind in TAKEN_KINDS:
            out.append((kind, str(meta.get("name")), str(found)))
    return sorted(out)


def defaulted_condition(conds: list[dict[str, Any]], found: list[tuple[str, str, str]], now: str,
                        generation: int, *, queued: bool) -> list[dict[str, Any]]:
    """The job's KueueDefaulted condition: True naming what Kueue took and the setting it lacks;
    gone when nothing is (any more)."""
    if not found:
        return [x for x in conds if x.get("type") != DEFAULTED]
    names = ", ".join(f"{kind} {name}" for kind, name, _ in found[:3]) + (" ..." if len(found) > 3 else "")
    queues = sorted({q for _, _, q in found})
    label = "" if queued else f"; or label the job {QUEUE_LABEL} so that Kueue admits it as one Workload"
    return c.set_condition(
        conds, DEFAULTED, True, reason="DefaultLocalQueue", now=now, generation=generation,
        message=f"Kueue's default integrations put {names} of this job in LocalQueue {', '.join(queues)} (its "
                f"namespace's default): Kueue makes a Workload of their own for them, counting their quota a second "
                f"time and holding their pods. Add {EXTERNAL_FRAMEWORK!r} to Kueue's integrations.externalFrameworks "
                f"(its manager's configuration), so that Kueue leaves a DecoupledDiLoCoJob's children to the "
                f"operator{label}")


def queue(config_kueue: bool, labels: Mapping[str, str] | None) -> str | None:
    """The LocalQueue a job is queued in: its label, when this operator integrates with Kueue."""
    return ((labels or {}).get(QUEUE_LABEL) or None) if config_kueue else None


def workload_name(job: str, uid: str) -> str:
    """Like Kueue's names for its jobs' Workloads: the uid's hash, so a job re-created under the
    same name never inherits the old one's admission while the garbage collector catches up."""
    return f"diloco-{job}-{hashlib.sha256(uid.encode()).hexdigest()[:5]}"[:MAX_NAME]


def problems(job: DecoupledDiLoCoJob) -> list[str]:
    """What Kueue would refuse: more PodSets than it allows, a group the syncer's PodSet shadows,
    topology annotations (the job's, a group's or the syncer's) its jobframework refuses."""
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
    out += _resource_problems(job)
    out += topology.problems("metadata.annotations", job.metadata.annotations)
    for i, g in enumerate(groups):
        for where, found in _template_annotations(f"spec.learnerGroups[{i}]", g.pod, g.template):
            out += topology.problems(where, found)
    for where, found in _template_annotations("spec.syncer", job.spec.syncer.pod, job.spec.syncer.template):
        out += topology.problems(where, found)
    return out


def _resource_problems(job: DecoupledDiLoCoJob) -> list[str]:
    """Containers asking for Kueue's reserved `pods` resource: its webhook refuses the Workload."""
    places: list[tuple[str, Any]] = []
    for i, g in enumerate(job.spec.learner_groups):
        places.append((f"spec.learnerGroups[{i}].resources", g.resources.model_dump()))
        places += _template_resources(f"spec.learnerGroups[{i}].template.spec", g.template)
    places.append(("spec.syncer.resources", job.spec.syncer.resources.model_dump()))
    places += _template_resources("spec.syncer.template.spec", job.spec.syncer.template)
    return [f"{where}.{kind}[{RESERVED_RESOURCE}]: Kueue reserves the resource name {RESERVED_RESOURCE!r} "
            f"(it counts a PodSet's pods under it) and refuses a Workload whose containers ask for it; remove it"
            for where, res in places for kind in ("requests", "limits")
            if RESERVED_RESOURCE in ((res or {}).get(kind) or {})]


def _template_resources(where: str, template: Any) -> list[tuple[str, Any]]:
    if template is None:
        return []
    out = []
    for key in ("initContainers", "containers"):
        for j, container in enumerate(template.spec.get(key) or []):
            if isinstance(container, dict):
                out.append((f"{where}.{key}[{j}].resources", container.get("resources")))
    return out


def _template_annotations(where: str, pod: Any, template: Any) -> list[tuple[str, Mapping[str, str]]]:
    out: list[tuple[str, Mapping[str, str]]] = []
    if pod is not None:
        out.append((f"{where}.pod.annotations", pod.annotations))
    if template is not None:
        out.append((f"{where}.template.metadata.annotations", template.metadata.annotations))
    return out


def _template(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template without its config-hash annotation: a training setting changed on an admitted
    job must not re-queue it (a changed PodSet replaces the Workload), only what Kueue reads."""
    return {**template, "metadata": {"labels": template["metadata"]["labels"]}}


def _annotations(template: Mapping[str, Any]) -> Mapping[str, str]:
    return (template.get("metadata") or {}).get("annotations") or {}


def pod_sets(job: DecoupledDiLoCoJob, owner: Owner, link: access.Link | None = None) -> list[dict[str, Any]]:
    """One PodSet per learner group, then the syncer's: what Kueue reserves quota for, the whole
    job (`first` makes the first Workload of an elastic job from these)."""
    link = link or access.link(job, owner.namespace, {})
    out = []
    for g in job.spec.learner_groups:
        # A multi-host learner's gangs differ only in their index: any one stands for all.
        template = learners.pod_template(job, owner, g, link=link, index=0 if learners.is_gang(g) else None)
        pod_set = {"name": g.name, "count": g.replicas * g.hosts_per_learner, "template": _template(template)}
        request = topology.request(_annotations(template), job.metadata.annotations,
                                   gang_count=g.replicas if learners.is_gang(g) else None, hosts=g.hosts_per_learner)
        out.append({**pod_set, **({"topologyRequest": request} if request else {})})
    if job.spec.syncer.external is None:
        template = render.syncer_pod_template(job, owner)
        request = topology.request(_annotations(template), {}, gang_count=None, hosts=1)
        out.append({"name": SYNCER_POD_SET, "count": syncer_pods(job), "template": _template(template),
                    **({"topologyRequest": request} if request else {})})
    return out


def elastic(job: DecoupledDiLoCoJob) -> bool:
    """Whether any learner group may run on part of its replicas (`minReplicas`): its first
    Workload may be admitted in part, and slices grow it (operator/kueue/slices.py)."""
    return any(g.min_replicas is not None and g.min_replicas < g.replicas for g in job.spec.learner_groups)


def whole(job: DecoupledDiLoCoJob) -> dict[str, int]:
    """Pods each PodSet asks for when the job runs whole."""
    out = {g.name: g.replicas * g.hosts_per_learner for g in job.spec.learner_groups}
    return {**out, **({SYNCER_POD_SET: syncer_pods(job)} if job.spec.syncer.external is None else {})}


def syncer_pods(job: DecoupledDiLoCoJob) -> int:
    """The syncer's pods here: one per shard, two with a standby (spec.syncer.standby). The standby
    waits with its requests held on a node, so Kueue must reserve quota for it too."""
    return job.spec.syncer.shards * render.syncer_members(job)


def must_be_ready(job: DecoupledDiLoCoJob, counts: Mapping[str, int]) -> dict[str, int]:
    """The Ready pods each PodSet needs for PodsReady: all it was given, but one syncer per shard,
    since a standby is never Ready (only its shard's lease holder opens the gRPC port its
    readiness probe dials: operator/render/job.py) and would otherwise time the job out; none
    where each shard's other member runs in another cluster (either may be the one standing by)."""
    standby = job.spec.syncer.standby
    if standby is None or SYNCER_POD_SET not in counts:
        return dict(counts)
    ready = 0 if standby.elsewhere else min(counts[SYNCER_POD_SET], job.spec.syncer.shards)
    return {**counts, SYNCER_POD_SET: ready}


def first(job: DecoupledDiLoCoJob, sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The PodSets of an elastic job's first Workload, from the whole job's (`pod_sets`). Kueue
    takes a minCount on one PodSet at most, and none on a Workload marked elastic
    (pkg/webhooks/workload_webhook.go, ValidateWorkload: "at most one podSet can use minCount",
    "partial admission and elastic job cannot be used together"). So the first Workload is not
    marked elastic: the first group with `minReplicas` asks for its replicas with minCount
    `minReplicas` (partial admission: Kueue gives as many as fit, never fewer), every other group
    with `minReplicas` asks for exactly that many; what any of them was not given, a slice asks
    for later (operator/kueue/slices.py)."""
    flexible = [g for g in job.spec.learner_groups if g.min_replicas is not None and g.min_replicas < g.replicas]
    lowest = {g.name: g.min_replicas for g in flexible}
    partial = flexible[0].name if flexible else None
    out = []
    for p in sets:
        if p["name"] == partial:
            out.append({**p, "minCount": lowest[p["name"]]})
        elif p["name"] in lowest:
            out.append({**p, "count": lowest[p["name"]]})
        else:
            out.append(p)
    return out


def workload(job: DecoupledDiLoCoJob, owner: Owner, queue_name: str, link: access.Link | None = None, *,
             version: str = NEWEST, priority: Priority | None = None) -> dict[str, Any]:
    """The job's first Workload in Kueue API `version` (spec only: its status is Kueue's): the
    whole job, or an elastic job's least (`first`), with what Kueue's integrations put on theirs
    (FINALIZER, JOB_UID_LABEL)."""
    md = meta(owner, workload_name(owner.name, owner.uid))
    if _LABEL_VALUE.fullmatch(owner.uid):  # as Kueue: the label only where the uid is a valid label value
        md["labels"] = {**md["labels"], JOB_UID_LABEL: owner.uid}
    md["finalizers"] = [FINALIZER]
    return {"apiVersion": f"{KUEUE_GROUP}/{version}", "kind": KIND,
            "metadata": md,
            "spec": {"queueName": queue_name, "podSets": first(job, pod_sets(job, owner, link)),
                     **priority_fields(priority, version)}}


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


# What a held Workload keeps: its PodSets (Kueue refuses changing them), its queue, and the
# priority class it names (v1beta1 refuses a changed source); the priority's value may change.
HELD = ("podSets", "queueName", "priorityClassName", "priorityClassSource", "priorityClassRef")


def stale(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """A held Workload whose PodSets, queue or priority class no longer match the job: Kueue
    refuses changing them, so it is replaced (deleted, then created afresh and queued again)."""
    if live is None or not holds_quota(live):
        return False
    spec, want = live.get("spec") or {}, desired["spec"]
    return any(not drift.contains(spec.get(k), want[k]) for k in HELD if k in want)


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
        if holds_quota(live):
            return Gate(True, False, "Evicted", f"Kueue evicted {where} ({why}); stopping its pods, then its quota "
                                                "is given back")
        if ((live or {}).get("spec") or {}).get("active") is False:
            return Gate(True, False, "Deactivated", f"Kueue evicted {where} ({why}) and it is inactive; set its "
                                                    "spec.active to true to queue it again")
        return Gate(True, False, "Requeued", f"Kueue evicted {where} ({why}); its quota is given back and it waits "
                                             "in its queue again, to resume from the syncer's checkpoint")
    if admitted(live):
        cq = (((live or {}).get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        return Gate(False, True, "Admitted", f"Kueue admitted {where}" + (f" to ClusterQueue {cq}" if cq else ""))
    return Gate(True, False, "WaitingForAdmission", f"suspended until Kueue admits {where}")


def condition(conds: list[dict[str, Any]], g: Gate | None, now: str, generation: int) -> list[dict[str, Any]]:
    """The job's Admitted condition; gone when the job is not queued (any more)."""
    if g is None:
        return [x for x in conds if x.get("type") != JOB_ADMITTED]
    return c.set_condition(conds, JOB_ADMITTED, g.admitted, reason=g.reason, message=g.message, now=now,
                           generation=generation)
