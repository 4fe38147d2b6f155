"""A home job's remote parts decided, pure: what to write in each cluster, and how each cluster's
health shows on the home job (status.clusters, the remote groups, condition ClustersReachable
and an Event when a cluster is lost or back).

A region lost is a condition, never a failure: the home job keeps running, the lost cluster's
learners keep training if they still reach the syncer, and its part is reconciled when its API
server answers again. Its last known groups stay in the status, marked by their cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from diloco.operator.reconcile.actions import Event
from diloco.operator.remote import parts
from diloco.operator.status import conditions as c
from diloco.spec import KIND, RemoteCluster

CONDITION = "ClustersReachable"
UNREACHABLE, REACHABLE, CONFLICT = "ClusterUnreachable", "ClusterReachable", "RemotePartConflict"


@dataclass(frozen=True)
class Seen:
    """One remote cluster as a pass read it; `problem` says why it could not be read or used."""

    cluster: RemoteCluster
    namespace: str  # where its part lives
    kube: Any = None  # its client (operator/remote/clients.py); None when its credentials are unusable
    problem: str = ""
    job: dict[str, Any] | None = None  # the part's job and Secret as read (None: absent)
    secret: dict[str, Any] | None = None
    credentials_gone: bool = False  # its kubeconfig Secret is deleted: the home job lets the part go

    @property
    def reachable(self) -> bool:
        return not self.problem


@dataclass(frozen=True)
class Write:
    """One write in a remote cluster: create, replace (a PUT of the whole object) or delete."""

    cluster: str
    kube: Any
    verb: Literal["create", "replace", "delete"]
    kind: str
    namespace: str
    name: str
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class Remote:
    writes: tuple[Write, ...] = ()
    clusters: tuple[dict[str, Any], ...] = ()  # status.clusters
    groups: tuple[dict[str, Any], ...] = ()  # the remote groups' status.learnerGroups entries, with their cluster
    events: tuple[Event, ...] = ()


def writes_for(home: parts.Home, seen: Seen) -> tuple[Write, ...]:
    """The part's Secret, then its job, wherever what is there differs from what the home job says."""
    out = []
    for desired, live in ((parts.desired_secret(home, seen.cluster), seen.secret),
                          (parts.desired_job(home, seen.cluster), seen.job)):
        if parts.differs(live, desired):
            out.append(Write(seen.cluster.name, seen.kube, "create" if live is None else "replace", desired["kind"],
                             seen.namespace, desired["metadata"]["name"], parts.replacement(live, desired)))
    return tuple(out)


def removals(home_name: str, home_uid: str, seen: Seen) -> tuple[Write, ...]:
    """A cluster the home job no longer names (or a home job being deleted): its part goes, job first."""
    return tuple(Write(seen.cluster.name, seen.kube, "delete", kind, seen.namespace, name)
                 for kind, name, live in ((KIND, home_name, seen.job),
                                          ("Secret", parts.secret_name(home_name), seen.secret))
                 if live is not None and ((live.get("metadata") or {}).get("annotations") or {}).get(parts.HOME_UID)
                 == home_uid)


def conflict(home: parts.Home, seen: Seen) -> str:
    """Objects of the part's names there that are not this home job's are never overwritten."""
    theirs = [f"{kind} {seen.namespace}/{home.name if kind == KIND else parts.secret_name(home.name)}"
              for kind, live in ((KIND, seen.job), ("Secret", seen.secret)) if not parts.owned(live, home)]
    return (f"{' and '.join(theirs)} there belong to someone else (no {parts.HOME_UID} of this job); delete or "
            "rename them, or name another namespace in spec.clusters") if theirs else ""


def decide(home: parts.Home, seen: Sequence[Seen], gone: Sequence[Seen], old: dict[str, Any],
           conditions: list[dict[str, Any]], *, stamp: str, generation: int) -> tuple[Remote, list[dict[str, Any]]]:
    """The writes, the status patch, the Events, and the conditions with ClustersReachable set."""
    before = {x.get("name"): x for x in old.get("clusters") or []}
    writes: list[Write] = []
    entries, groups, events, trouble = [], [], [], list[tuple[str, str]]()
    for s in seen:
        problem, reason = s.problem, UNREACHABLE
        if not problem and (problem := conflict(home, s)):
            reason = CONFLICT
        elif not problem and not home.endpoints:
            problem, reason = "waiting for the syncer's exposed address (status.syncer.exposedAddress)", ""
        elif not problem:
            writes += writes_for(home, s)
        was = before.get(s.cluster.name) or {}
        status = (s.job or {}).get("status") or {}
        entry = {"name": s.cluster.name, "namespace": s.namespace, "kubeconfigSecret": s.cluster.kubeconfig_secret,
                 "reachable": s.reachable, "phase": status.get("phase", "") if s.reachable else was.get("phase", ""),
                 "learners": status.get("learners", "") if s.reachable else was.get("learners", ""),
                 "message": problem,
                 "lastTransitionTime": stamp if was.get("reachable", True) != s.reachable or not was
                 else was.get("lastTransitionTime", stamp)}
        entries.append(entry)
        mine = [{**g, "cluster": s.cluster.name} for g in status.get("learnerGroups") or []] if s.reachable else \
            [g for g in old.get("learnerGroups") or [] if g.get("cluster") == s.cluster.name]
        groups += mine
        if problem and reason:
            trouble.append((reason, f"cluster {s.cluster.name}: {problem}"))
        if not s.reachable and was.get("reachable", True):
            events.append(Event(UNREACHABLE, f"cluster {s.cluster.name} (Secret {s.cluster.kubeconfig_secret}): "
                                f"{s.problem}; its learners train on while they reach the syncer, and its part is "
                                "reconciled when the cluster answers again", warning=True))
        elif s.reachable and was.get("reachable") is False:
            events.append(Event(REACHABLE, f"cluster {s.cluster.name} answers again; its part is reconciled"))
        elif reason == CONFLICT and was.get("message") != problem:
            events.append(Event(CONFLICT, f"cluster {s.cluster.name}: {problem}", warning=True))
    for g in gone:
        writes += removals(home.name, home.uid, g)
        if not g.reachable:  # kept in the status until its part is gone
            entries.append({**(before.get(g.cluster.name) or {}), "reachable": False, "message":
                            f"removed from spec.clusters; its part is deleted when it answers: {g.problem}"})
    conds = c.set_condition(conditions, CONDITION, not trouble, reason=trouble[0][0] if trouble else REACHABLE,
                            message="; ".join(m for _, m in trouble) if trouble else
                            f"all {len(seen)} remote cluster(s) answer and hold their parts",
                            now=stamp, generation=generation)
    return Remote(tuple(writes), tuple(entries), tuple(groups), tuple(events)), conds
