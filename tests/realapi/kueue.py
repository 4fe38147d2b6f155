"""Kueue's side of a Workload's life, played on the real API server from what Kueue's source does.

Kueue cannot be downloaded here, so its CRDs are stand-ins (kueue-workload-crd.yaml) and this
plays its controllers, writing only what they write and leaving every step the job integration
owns to the operator (never clearing an admission itself). One ClusterQueue with a quota of
`quota` pods (Kueue's `pods` resource) on one ResourceFlavor, BestEffortFIFO, preemption
`withinClusterQueue: LowerPriority`. Each `step` does, in Kueue's order:

- the workload controller: a Workload with `spec.active: false` that holds quota is evicted
  (Evicted, reason Deactivated); with `pods_ready_timeout` (waitForPodsReady), one admitted
  longer than that without PodsReady True is evicted (reason PodsReadyTimeout);
- the scheduler, Workloads without quota by priority then age: admitted whole if they fit; else,
  with a PodSet's `minCount`, the largest counts that fit (PartialAdmission's podset reducer:
  every PodSet's count lowered together toward its minCount); a workload slice (annotated as the
  replacement of one that holds quota) against the difference only, finishing the one it
  replaces (WorkloadSliceReplaced); else lower-priority Workloads are evicted (Preempted, with
  the Preempted condition) until it would fit, and it waits for their quota to come back, which
  only the integration's release does.

Admission writes QuotaReserved and Admitted True, Evicted False where it was True, and the
admission (the ClusterQueue, each PodSet's count and flavor). Quota is counted from what holds
it (QuotaReserved True or an admission), so an evicted Workload whose integration never
releases it keeps its pods' worth forever, as in Kueue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from diloco.operator.kube import ApiError, Kube
from diloco.operator.kueue import integration as k
from diloco.operator.status.conditions import find

SLICE_OF = "kueue.x-k8s.io/workload-slice-replacement-for"


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cond(type_: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": _stamp()}


def _set(conds: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in conds if c["type"] != new["type"]] + [new]


def _counts(wl: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["count"]) for p in wl["spec"]["podSets"]}


def _held(wl: dict[str, Any]) -> int:
    """Pods of quota the Workload holds: its admission's counts."""
    status = wl.get("status") or {}
    if not (k.holds_quota(wl) and not k.finished(wl)):
        return 0
    return sum(int(a.get("count", 0)) for a in (status.get("admission") or {}).get("podSetAssignments") or [])


class Kueue:
    def __init__(self, api: Kube, namespace: str, *, quota: int, cluster_queue: str, flavor: str,
                 pods_ready_timeout: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.namespace, self.quota = api, namespace, quota
        self.cluster_queue, self.flavor, self.pods_ready_timeout, self.clock = cluster_queue, flavor, \
            pods_ready_timeout, clock
        self.admitted_at: dict[str, float] = {}  # uid -> when it was admitted (the PodsReady timer)
        self.log: list[tuple[str, str]] = []  # (what, Workload name), in order

    def workloads(self) -> list[dict[str, Any]]:
        return self.api.list("Workload", self.namespace)

    def _status(self, wl: dict[str, Any], status: dict[str, Any]) -> None:
        md = wl["metadata"]
        try:
            self.api.patch("Workload", md["namespace"], md["name"],
                           {"metadata": {"resourceVersion": md["resourceVersion"]}, "status": status}, sub="status")
        except ApiError as exc:
            if exc.status not in (404, 409):  # changed meanwhile: the next step sees it again
                raise

    def evict(self, wl: dict[str, Any], reason: str, message: str) -> None:
        conds = _set(list(wl["status"].get("conditions") or []), _cond("Evicted", True, reason, message))
        if reason == "Preempted":
            conds = _set(conds, _cond("Preempted", True, "InClusterQueue", message))
        self._status(wl, {"conditions": conds})
        self.log.append((f"evicted:{reason}", wl["metadata"]["name"]))

    def admit(self, wl: dict[str, Any], counts: dict[str, int]) -> None:
        conds = list((wl.get("status") or {}).get("conditions") or [])
        conds = _set(_set(conds, _cond("QuotaReserved", True, "QuotaReserved", f"Quota reserved in ClusterQueue "
                                                                             f"{self.cluster_queue}")),
                     _cond("Admitted", True, "Admitted", "The workload is admitted"))
        if k.evicted(wl):
            conds = _set(conds, _cond("Evicted", False, "QuotaReserved", "Previously: evicted"))
            conds = _set(conds, _cond("Preempted", False, "QuotaReserved", "Previously: preempted"))
        assignments = [{"name": name, "count": count, "flavors": {"pods": self.flavor},
                        "resourceUsage": {"pods": str(count)}} for name, count in counts.items()]
        self._status(wl, {"conditions": conds, "admission": {"clusterQueue": self.cluster_queue,
                                                             "podSetAssignments": assignments}})
        self.admitted_at[wl["metadata"]["uid"]] = self.clock()
        self.log.append((f"admitted:{sum(counts.values())}", wl["metadata"]["name"]))

    def finish(self, wl: dict[str, Any], reason: str, message: str) -> None:
        conds = _set(list((wl.get("status") or {}).get("conditions") or []), _cond("Finished", True, reason, message))
        self._status(wl, {"conditions": conds})
        self.log.append((f"finished:{reason}", wl["metadata"]["name"]))

    def step(self) -> None:
        wls = [w for w in self.workloads() if not w["metadata"].get("deletionTimestamp")]
        for wl in wls:  # the workload controller
            if not k.holds_quota(wl) or k.evicted(wl) or k.finished(wl):
                continue
            if wl["spec"].get("active") is False:
                self.evict(wl, "Deactivated", "The workload is deactivated")
            elif self.pods_ready_timeout is not None and k.admitted(wl):
                ready = (find(wl["status"].get("conditions") or [], "PodsReady") or {}).get("status") == "True"
                since = self.admitted_at.setdefault(wl["metadata"]["uid"], self.clock())
                if not ready and self.clock() - since > self.pods_ready_timeout:
                    self.evict(wl, "PodsReadyTimeout", f"Exceeded the PodsReady timeout {self.namespace}/"
                                                       f"{wl['metadata']['name']}")
        wls = [w for w in self.workloads() if not w["metadata"].get("deletionTimestamp")]
        by_key = {f"{w['metadata']['namespace']}/{w['metadata']['name']}": w for w in wls}
        free = self.quota - sum(_held(w) for w in wls)
        pending = [w for w in wls if not k.holds_quota(w) and not k.finished(w) and w["spec"].get("active") is not False]
        pending.sort(key=lambda w: (-int(w["spec"].get("priority") or 0), w["metadata"]["creationTimestamp"]))
        for wl in pending:  # the scheduler
            counts = _counts(wl)
            replaced = by_key.get((wl["metadata"].get("annotations") or {}).get(SLICE_OF, ""))
            if replaced is not None and k.holds_quota(replaced) and not k.finished(replaced):
                if sum(counts.values()) - _held(replaced) <= free:
                    free -= sum(counts.values()) - _held(replaced)
                    self.admit(wl, counts)
                    self.finish(replaced, "WorkloadSliceReplaced", "Replaced to accommodate a workload due to "
                                                                   "workload slice aggregation")
                continue
            fitting = self._fit(wl, free)
            if fitting is not None:
                free -= sum(fitting.values())
                self.admit(wl, fitting)
                continue
            self._preempt_for(wl, free, wls)

    def _fit(self, wl: dict[str, Any], free: int) -> dict[str, int] | None:
        """Whole, else the largest partial admission (every PodSet lowered together toward its
        minCount, as Kueue's PodSetReducer searches)."""
        full = _counts(wl)
        if sum(full.values()) <= free:
            return full
        deltas = {p["name"]: int(p["count"]) - int(p.get("minCount", p["count"])) for p in wl["spec"]["podSets"]}
        total = sum(deltas.values())
        for i in range(1, total + 1):
            counts = {name: full[name] - deltas[name] * i // total for name in full}
            if sum(counts.values()) <= free:
                return counts
        return None

    def _preempt_for(self, wl: dict[str, Any], free: int, wls: list[dict[str, Any]]) -> None:
        """Evict lower-priority holders, lowest first and newest first, if that makes it fit."""
        priority, need = int(wl["spec"].get("priority") or 0), sum(_counts(wl).values())
        minimum = sum(int(p.get("minCount", p["count"])) for p in wl["spec"]["podSets"])
        victims = sorted((w for w in wls if _held(w) and not k.evicted(w)
                          and int(w["spec"].get("priority") or 0) < priority),
                         key=lambda w: w["metadata"]["creationTimestamp"], reverse=True)  # newest first
        victims.sort(key=lambda w: int(w["spec"].get("priority") or 0))  # then the lowest priority first
        chosen, freed = [], 0
        for v in victims:
            if free + freed >= min(need, minimum):
                break
            chosen.append(v)
            freed += _held(v)
        if chosen and free + freed >= min(need, minimum):
            for v in chosen:
                self.evict(v, "Preempted", f"Preempted to accommodate a workload (UID: {wl['metadata']['uid']}) due "
                                           "to prioritization in the ClusterQueue")

    @contextmanager
    def running(self, period: float = 0.5) -> Iterator[Kueue]:
        """Kueue's controllers in a thread, a step every `period` seconds."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(period):
                try:
                    self.step()
                except Exception as exc:
                    self.log.append(("error", repr(exc)))

        thread = threading.Thread(target=loop, name="kueue", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(10)
