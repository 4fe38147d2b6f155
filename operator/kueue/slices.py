"""Elastic admission: a queued job runs on the learners Kueue gives it and grows without a restart.

A Decoupled DiLoCo job trains on any number of learners, and a learner that joins later starts
on its own shard; so unlike an all-or-nothing training job it can take part of its quota now and
the rest when it frees. Kueue has both halves, and the operator uses them as Kueue's job framework
does for its own kinds:

- partial admission (Kueue's PartialAdmission feature, on by default): a learner group's
  `minReplicas` is its PodSet's `minCount`, and Kueue may admit fewer pods than the PodSet's
  count, never fewer than that; the count it gave is in `status.admission.podSetAssignments[].count`,
  and the job runs that many learners of the group;
- workload slices (ElasticJobsViaWorkloadSlices, beta since Kueue v0.18; the Workload annotated
  `kueue.x-k8s.io/elastic-job`): a job that wants more than it holds gets a second Workload, a
  slice of its whole size annotated as the replacement of the held one
  (`kueue.x-k8s.io/workload-slice-replacement-for`); Kueue admits it against the difference only,
  then finishes the old one (reason WorkloadSliceReplaced), so the running learners never stop. A
  job that shrinks has the held Workload's counts lowered in place (Kueue's EnsureWorkloadSlices),
  which gives the difference back at once.

Kueue's own batch Job takes one or the other (its webhook refuses both on one job); here the first
Workload may be admitted in part, and what it was not given is queued as a slice of the whole size
(which takes no partial admission: it waits until all of the rest fits). Pure: the caller reads
the Workloads and applies what `plan` returns.
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


def stale(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """kueue.stale, where a held elastic Workload may differ from the job in its counts: those
    change by a slice or in place (`plan`), anything else still replaces it."""
    if live is None or kueue.ELASTIC not in _annotations(live):
        return kueue.stale(live, desired)
    spec, want = live.get("spec") or {}, desired["spec"]
    return kueue.stale({**live, "spec": {**spec, "podSets": _shape(spec.get("podSets") or [])}},
                       {**desired, "spec": {**want, "podSets": _shape(want["podSets"])}})


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


def plan(desired: Mapping[str, Any], live: list[dict[str, Any]], *, generation: int) -> Slices:
    """The job's Workloads from the one it would have whole (`desired`, kueue.workload) and those
    live (`live`, the job's own): the one holding quota kept (its counts lowered if the job
    shrank), a slice of the whole size queued beside it while it holds less than the job asks, and
    the job runs what the held one was given, never more than it asks now."""
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
    want, has, got = counts(desired), counts(held), given(held)
    keep = {k: _annotations(held)[k] for k in SLICE_KEYS if k in _annotations(held)}
    shrunk = [{**p, "count": min(int(p["count"]), has.get(p["name"], int(p["count"]))),
               **({"minCount": min(int(p["minCount"]), int(p["count"]))} if "minCount" in p else {})}
              for p in desired["spec"]["podSets"]]
    out = [_named(desired, held["metadata"]["name"], keep, shrunk)]
    if any(want[p] > got.get(p, 0) for p in want):
        origin = keep.get(SLICE_NAME, held["metadata"]["name"])
        name = waiting["metadata"]["name"] if waiting is not None else f"{desired['metadata']['name']}-{generation}"
        whole = [{k: v for k, v in p.items() if k != "minCount"} for p in desired["spec"]["podSets"]]
        out.append(_named(desired, name, {SLICE_NAME: origin, REPLACEMENT_FOR:
                                          f"{held['metadata']['namespace']}/{held['metadata']['name']}"}, whole))
    return Slices(held, waiting, out, {p: min(n, want.get(p, n)) for p, n in got.items()})


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
