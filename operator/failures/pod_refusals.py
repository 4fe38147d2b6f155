"""Pods the cluster refuses for the job's workloads, read from the controllers' own signals.

A ResourceQuota on `pods` or `requests.cpu`, PodSecurity `enforce`, a Kyverno or Gatekeeper pod
rule refuse the *pods* the StatefulSet and ReplicaSet controllers create, not the children the
operator writes, so children.sync never sees them. The controllers say so themselves: the
StatefulSet controller posts a `FailedCreate` Warning Event on the StatefulSet per refused pod
("create Pod <pod> in StatefulSet <set> failed error: <the API server's message>"), the
ReplicaSet controller one on the ReplicaSet ("Error creating: <message>") and the condition
`ReplicaFailure` (reason FailedCreate) that the Deployment controller copies onto the
Deployment and both remove once a creation succeeds. The kubelet refuses to start a container
whose Secret or ConfigMap is missing: `CreateContainerConfigError` in its status.

Only a live refusal counts. Events outlive what they report (an hour), so a FailedCreate is
over once the pod it names exists, once a creation of that pod succeeded after it
(SuccessfulCreate, compared by lastTimestamp), or once the workload has every pod it wants
(status.replicas against spec.replicas). `found` decides that, purely, from what `read` observed;
`read` asks for Events (by involvedObject.uid) and ReplicaSets only for a workload short of pods,
so the pass over a job whose pods all exist reads nothing more. operator/failures/refusals.py classifies the
messages and shows them on the job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from diloco.operator.failures import refusals
from diloco.operator.kube import Kube
from diloco.operator.status.job import parse_time

STATEFULSET, DEPLOYMENT = "StatefulSet", "Deployment"
FAILED, CREATED = "FailedCreate", "SuccessfulCreate"  # the controllers' Event reasons
REPLICA_FAILURE = "ReplicaFailure"  # a Deployment's (and ReplicaSet's) condition type
REVISION = "deployment.kubernetes.io/revision"  # the newest ReplicaSet of a Deployment has the highest
CONFIG_WAITING = "CreateContainerConfigError"
# The StatefulSet controller's messages (stateful_pod_control.go): the pod is named, also for
# its claims ("create Claim <claim> for Pod <pod> in StatefulSet ...").
_STS_EVENT = re.compile(r"^create (?:Pod (\S+)|Claim \S+ for Pod (\S+)) in StatefulSet \S+ "
                        r"(?:failed error: (.*)|successful)$", re.DOTALL)
_RS_FAILED = "Error creating: "  # the ReplicaSet controller's FailedCreate message, then the API server's
_COMBINED = "(combined from similar events): "  # client-go's aggregation of >10 similar Events

Obj = dict[str, Any]


@dataclass(frozen=True)
class Observed:
    """What the pass read: the job's workloads (StatefulSets and Deployments, as children.sync
    left them), the ReplicaSets of the short Deployments, the Events of the short workloads and
    ReplicaSets, and the job's pods."""

    workloads: list[Obj]
    pods: list[Obj]
    replica_sets: list[Obj] = field(default_factory=list)
    events: list[Obj] = field(default_factory=list)


def _spec_replicas(obj: Obj) -> int:
    value = (obj.get("spec") or {}).get("replicas")
    return 1 if value is None else int(value)


def short(obj: Obj) -> bool:
    """Whether a StatefulSet, ReplicaSet or Deployment has fewer pods than it wants (its
    controller's status; a Deployment counts the pods of its newest template)."""
    if obj["metadata"].get("deletionTimestamp"):
        return False
    status = obj.get("status") or {}
    have = status.get("updatedReplicas" if obj.get("kind") == DEPLOYMENT else "replicas")
    return int(have or 0) < _spec_replicas(obj)


def _failure_condition(obj: Obj) -> Obj | None:
    return next((x for x in (obj.get("status") or {}).get("conditions") or []
                 if x.get("type") == REPLICA_FAILURE and x.get("status") == "True"), None)


def _when(event: Obj) -> float:
    """When the Event last happened (its repeats update lastTimestamp; events.k8s.io/v1 ones
    carry series or eventTime instead)."""
    for value in (event.get("lastTimestamp"), (event.get("series") or {}).get("lastObservedTime"),
                  event.get("eventTime"), event.get("firstTimestamp"), event["metadata"].get("creationTimestamp")):
        if value:
            return parse_time(value) or 0.0
    return 0.0


def _about(events: list[Obj], uid: str) -> list[Obj]:
    return [e for e in events if (e.get("involvedObject") or {}).get("uid") == uid]


def _pod_refusal(message: str, *, pod: str, owner: str) -> refusals.Refusal:
    reason, by, hint = refusals.classify(message, verb="create")
    return refusals.Refusal("Pod", pod, "create", reason, message, by=by, owner=owner, hint=hint)


def _statefulset(sts: Obj, events: list[Obj], pods: set[str]) -> list[refusals.Refusal]:
    """The pods of a short StatefulSet whose latest creation was refused and that do not exist."""
    name = sts["metadata"]["name"]
    wanted = {f"{name}-{i}" for i in range(_spec_replicas(sts))}
    created: dict[str, float] = {}  # pod -> its last successful creation
    failed: dict[str, tuple[float, str]] = {}  # pod -> (its last refusal, the API server's message)
    for event in _about(events, sts["metadata"].get("uid", "")):
        m = _STS_EVENT.match(str(event.get("message") or "").removeprefix(_COMBINED))
        if m is None or event.get("reason") not in (FAILED, CREATED):
            continue
        pod, when = m.group(1) or m.group(2), _when(event)
        if event["reason"] == CREATED:
            created[pod] = max(created.get(pod, 0.0), when)
        elif when >= failed.get(pod, (0.0, ""))[0]:
            failed[pod] = (when, m.group(3) or "")
    return [_pod_refusal(message, pod=pod, owner=f"{STATEFULSET} {name}")
            for pod, (when, message) in sorted(failed.items())
            if pod in wanted and pod not in pods and when >= created.get(pod, 0.0)]


def newest_replica_set(deployment: Obj, replica_sets: list[Obj]) -> Obj | None:
    """The Deployment's ReplicaSet of its newest template (the highest revision it owns)."""
    uid = deployment["metadata"].get("uid")
    owned = [rs for rs in replica_sets
             if any(ref.get("uid") == uid for ref in rs["metadata"].get("ownerReferences") or [])]
    return max(owned, key=lambda rs: int((rs["metadata"].get("annotations") or {}).get(REVISION) or 0),
               default=None)


def _deployment(deployment: Obj, replica_sets: list[Obj], events: list[Obj]) -> list[refusals.Refusal]:
    """A short Deployment's refused pod: its ReplicaFailure condition where the controller has
    copied it, else the newest ReplicaSet's latest FailedCreate that no creation followed."""
    owner = f"{DEPLOYMENT} {deployment['metadata']['name']}"
    failure = _failure_condition(deployment)
    if failure is not None:
        return [_pod_refusal(str(failure.get("message") or failure.get("reason") or ""), pod="", owner=owner)]
    rs = newest_replica_set(deployment, replica_sets)
    if rs is None or not short(rs):
        return []
    failure = _failure_condition(rs)
    if failure is not None:
        return [_pod_refusal(str(failure.get("message") or failure.get("reason") or ""), pod="", owner=owner)]
    mine = _about(events, rs["metadata"].get("uid", ""))
    last_created = max((_when(e) for e in mine if e.get("reason") == CREATED), default=0.0)
    refused = [e for e in mine if e.get("reason") == FAILED and _when(e) >= last_created]
    if not refused:
        return []
    message = str(max(refused, key=_when).get("message") or "").removeprefix(_COMBINED).removeprefix(_RS_FAILED)
    return [_pod_refusal(message, pod="", owner=owner)]


def config_errors(pods: list[Obj]) -> list[refusals.Refusal]:
    """Containers the kubelet will not start for what their pod names (CreateContainerConfigError)."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") != CONFIG_WAITING:
                continue
            detail = str(waiting.get("message") or CONFIG_WAITING)
            by, hint = refusals.config_error(detail)
            out.append(refusals.Refusal("Pod", pod["metadata"]["name"], "start", refusals.CONFIG,
                                        f"container {cs.get('name')}: {detail}", by=by, hint=hint))
            break  # one per pod: its containers name the same Secret, as a rule
    return out


def found(seen: Observed) -> list[refusals.Refusal]:
    """Pure: the pods refused now, StatefulSets' first (by name), then Deployments', then the
    containers the kubelet will not start."""
    pods = {p["metadata"]["name"] for p in seen.pods}
    out: list[refusals.Refusal] = []
    for obj in sorted(seen.workloads, key=lambda o: (o.get("kind") != STATEFULSET, o["metadata"]["name"])):
        if not short(obj):
            continue
        if obj.get("kind") == STATEFULSET:
            out.extend(_statefulset(obj, seen.events, pods))
        elif obj.get("kind") == DEPLOYMENT:
            out.extend(_deployment(obj, seen.replica_sets, seen.events))
    return out + config_errors(seen.pods)


def _events(api: Kube, namespace: str, uid: str) -> list[Obj]:
    """The Events about one object: those of this incarnation only (a name reused is another uid)."""
    items: list[Obj] = api.request("GET", f"api/v1/namespaces/{quote(namespace)}/events",
                                   params={"fieldSelector": f"involvedObject.uid={uid}"}).get("items") or []
    return items


def read(api: Kube, namespace: str, live: dict[tuple[str, str], Obj], pods: list[Obj]) -> Observed:
    """The observe step: the job's workloads from `live` (children.sync's), and for each one short
    of pods the Events about it (a Deployment: its ReplicaSets, and the newest one's Events,
    unless its ReplicaFailure condition already says). Nothing is read for a job with all its pods."""
    workloads = [{**obj, "kind": kind} for (kind, _), obj in sorted(live.items()) if kind in (STATEFULSET, DEPLOYMENT)]
    replica_sets: list[Obj] = []
    events: list[Obj] = []
    for obj in workloads:
        if not short(obj):
            continue
        if obj["kind"] == STATEFULSET:
            events.extend(_events(api, namespace, obj["metadata"]["uid"]))
            continue
        if _failure_condition(obj) is not None:
            continue
        labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        listed: list[Obj] = api.request(
            "GET", f"apis/apps/v1/namespaces/{quote(namespace)}/replicasets",
            params={"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))}).get("items") or []
        replica_sets.extend(listed)
        rs = newest_replica_set(obj, listed)
        if rs is not None and short(rs) and _failure_condition(rs) is None:
            events.extend(_events(api, namespace, rs["metadata"]["uid"]))
    return Observed(workloads, pods, replica_sets, events)
