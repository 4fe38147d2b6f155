"""Elastic admission: a queued job runs on the learners Kueue gives it and grows without a restart.

A Decoupled DiLoCo job trains on any number of learners, and a learner that joins later starts
on its own shard; so unlike an all-or-nothing training job it can take part of its quota now and
the rest when it frees. Kueue has both halves, and the operator uses each within Kueue's rules
(its Workload webhook refuses a PodSet's minCount on a Workload marked elastic, and a minCount on
more than one PodSet: pkg/webhooks/workload_webhook.go, ValidateWorkload):

- the first Workload takes partial admission (Kueue's PartialAdmission, on by default since
  v0.5): it is not marked elastic, and the first learner group with `minReplicas` carries it as
  its PodSet's minCount, so Kueue admits as many of that group as fit, never fewer
  (`status.admission.podSetAssignments[].count`); any other group with `minReplicas` asks for
  exactly that many (integration.first). The job runs what it was given.
- growth is by workload slices (ElasticJobsViaWorkloadSlices, beta and on by default since
  v0.18; pkg/workloadslicing): while the held Workload has less than the whole job, a slice of
  the whole size is queued beside it, marked elastic (`kueue.x-k8s.io/elastic-job`), with no
  minCount, as the replacement of the held one (`kueue.x-k8s.io/workload-slice-replacement-for`).
  Kueue's scheduler admits it against the difference only (flavorassigner: the replaced slice's
  usage is subtracted) and finishes the one it replaces (WorkloadSliceReplaced), so the running
  learners never stop. A slice is admitted whole or not at all (no minCount on it), so the
  operator sizes it: the whole job.
- shrinking: a held slice has its counts lowered in place (EnsureWorkloadSlices does the same;
  the webhook lets a held PodSet's count fall with ElasticJobsViaWorkloadSlices on), which gives
  the difference back at once. The first Workload is never changed while it holds quota (its
  minCount is immutable, and must stay at most its count): asking for fewer than it was given
  replaces it, as any other change of a held Workload does.

Pure: the caller reads the Workloads and applies what `plan` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco.operator.kueue import integration as kueue
from diloco.spec import DecoupledDiLoCoJob

SLICE_NAME = "kueue.x-k8s.io/workload-slice-name"  # the first slice's name, carried by each later one
REPLACEMENT_FOR = "kueue.x-k8s.io/workload-slice-replacement-for"  # namespace/name of the slice it replaces
SLICE_KEYS = (SLICE_NAME, REPLACEMENT_FOR)


def counts(wl: Mapping[str, Any]) -> dict[str, int]:
    """Pods each PodSet asks for."""
    return {str(p["name"]): int(p.get("count") or 0) for p in (wl.get("spec") or {}).get("podSets") or []}


def given(wl: Mapping[str, Any]) -> dict[str, int]:
    """Pods Kueue admitted for each PodSet: its assignment's count (fewer under partial admission),
    else the PodSet's own count."""
    out = counts(wl)
    for a in (((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []):
        if a.get("name") in out and a.get("count") is not None:
            out[str(a["name"])] = int(a["count"])
    return out


def _shape(pod_sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in p.items() if k not in ("count", "minCount")} for p in pod_sets]


def sliced(wl: Mapping[str, Any]) -> bool:
    """A slice the operator queued to grow the job (marked elastic), not its first Workload."""
    return _annotations(wl).get(kueue.ELASTIC) == "true"


def stale(live: Mapping[str, Any] | None, desired: Mapping[str, Any], *, whole: Mapping[str, int] | None = None,
          elastic: bool = False) -> bool:
    """kueue.stale, where an elastic job's held Workload may differ from the job in its counts:
    those change by a slice or in place (`plan`), anything else still replaces it; and so does
    asking for fewer than the held first Workload was given (it is never changed while held)."""
    if live is None or not kueue.holds_quota(live) or not (elastic or sliced(live)):
        return kueue.stale(live, desired)
    spec, want = live.get("spec") or {}, desired["spec"]
    if kueue.stale({**live, "spec": {**spec, "podSets": _shape(spec.get("podSets") or [])}},
                   {**desired, "spec": {**want, "podSets": _shape(want["podSets"])}}):
        return True
    wanted = dict(whole) if whole is not None else counts(desired)
    return not sliced(live) and any(wanted.get(p, 0) < n for p, n in given(live).items())


def _annotations(wl: Mapping[str, Any]) -> dict[str, str]:
    return dict((wl.get("metadata") or {}).get("annotations") or {})


@dataclass(frozen=True)
class Slices:
    """What a queued job's Workloads should be, and what it may run."""

    held: dict[str, Any] | None  # the Workload whose quota the job runs on (None: nothing held)
    waiting: dict[str, Any] | None = None  # the one in the queue: the job's whole, or a slice to grow it
    workloads: list[dict[str, Any]] = field(default_factory=list)  # to apply; any other of the job's goes
    admitted: dict[str, int] = field(default_factory=dict)  # pods each PodSet may run now


def _newest(wls: list[dict[str, Any]]) -> dict[str, Any] | None:
    return max(wls, key=lambda w: (w["metadata"].get("creationTimestamp") or "", w["metadata"]["name"]),
               default=None)


def _named(desired: Mapping[str, Any], name: str, annotations: Mapping[str, str],
           pod_sets: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    md = dict(desired["metadata"])
    md["name"] = name
    if annotations:  # no empty map where there is nothing to say: the desired Workload stays as rendered
        md["annotations"] = {**(md.get("annotations") or {}), **annotations}
    spec = dict(desired["spec"]) if pod_sets is None else {**desired["spec"], "podSets": pod_sets}
    return {**desired, "metadata": md, "spec": spec}


def plan(desired: Mapping[str, Any], live: list[dict[str, Any]], *, generation: int,
         whole: Mapping[str, int] | None = None) -> Slices:
    """The job's Workloads from its first one (`desired`, kueue.workload), the pods each PodSet
    asks for when whole (`whole`; default: `desired`'s counts) and those live (`live`, the job's
    own): the one holding quota kept (a held slice's counts lowered if the job shrank), a slice of
    the whole size queued beside it while it holds less than the job asks, and the job runs what
    the held one was given, never more than it asks now."""
    want = dict(whole) if whole is not None else counts(desired)
    active = [w for w in live if not kueue.finished(w) and not kueue.deleting(w)]
    holding = [w for w in active if kueue.holds_quota(w)]
    replaced = {_annotations(w).get(REPLACEMENT_FOR) for w in holding}
    # Between Kueue admitting a slice and finishing the one it replaces, both hold: the newer counts.
    held = _newest([w for w in holding if f"{w['metadata']['namespace']}/{w['metadata']['name']}" not in replaced]
                   or holding)
    waiting = _newest([w for w in active if not kueue.holds_quota(w)])
    if held is None:
        # Queued whole (again): under the name it already has, so its place in the queue is kept.
        name = waiting["metadata"]["name"] if waiting is not None else desired["metadata"]["name"]
        return Slices(None, waiting, [_named(desired, name, {})], {})
    has, got = counts(held), given(held)
    keep = {k: _annotations(held)[k] for k in (*SLICE_KEYS, kueue.ELASTIC) if k in _annotations(held)}
    if sliced(held):  # a slice: whole PodSets, counts lowered in place if the job shrank
        kept = [{**_plain(p), "count": min(want.get(p["name"], 0), has.get(p["name"], 0))}
                for p in desired["spec"]["podSets"]]
    else:  # the first Workload: never changed while it holds quota (its counts and minCount as they are)
        mine = {str(p["name"]): p for p in (held.get("spec") or {}).get("podSets") or []}
        kept = [{**_plain(p), **{k: mine.get(p["name"], {})[k] for k in ("count", "minCount")
                                  if k in mine.get(p["name"], {})}} for p in desired["spec"]["podSets"]]
    out = [_named(desired, held["metadata"]["name"], keep, kept)]
    if any(n > got.get(p, 0) for p, n in want.items()):
        origin = keep.get(SLICE_NAME, held["metadata"]["name"])
        name = waiting["metadata"]["name"] if waiting is not None else _fresh(
            f"{desired['metadata']['name']}-{generation}", {w["metadata"]["name"] for w in live})
        grown = [{**_plain(p), "count": want.get(p["name"], 0)} for p in desired["spec"]["podSets"]]
        out.append(_named(desired, name, {kueue.ELASTIC: "true", SLICE_NAME: origin, REPLACEMENT_FOR:
                                          f"{held['metadata']['namespace']}/{held['metadata']['name']}"}, grown))
    return Slices(held, waiting, out, {p: min(n, want.get(p, n)) for p, n in got.items()})


def _fresh(name: str, taken: set[str]) -> str:
    """`name`, or `name-<k>` for the least k free: a Workload queued again whole keeps the name it
    had (its place in the queue), which may be a slice's of this very generation."""
    k = 0
    while (candidate := name if k == 0 else f"{name}-{k}") in taken:
        k += 1
    return candidate


def _plain(pod_set: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in pod_set.items() if k != "minCount"}


def running(job: DecoupledDiLoCoJob, admitted: Mapping[str, int]) -> DecoupledDiLoCoJob:
    """The job as it runs on what Kueue admitted (`admitted`: pods per PodSet; empty: not
    admitted, nothing runs): each group's replicas cut to its admission. An elastic job's data
    shards are pinned to what its whole size gives them, so a learner reads the same shard
    whether it started with part of the job or all of it, and one admitted later starts on its
    own, as a scale-up does."""
    if not kueue.elastic(job):
        return job
    spec = job.spec
    offsets = spec.shard_offsets()
    groups = [g.model_copy(update={"shard_offset": offsets[i], "replicas": min(g.replicas, admitted.get(g.name, g.replicas))})
              for i, g in enumerate(spec.learner_groups)]
    data = spec.data.model_copy(update={"shards": spec.shard_count})
    return job.model_copy(update={"spec": spec.model_copy(update={"learner_groups": groups, "data": data})})
