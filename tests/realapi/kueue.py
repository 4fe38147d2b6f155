"""Kueue's side of a Workload's life, played on the real API server from what Kueue's source does.

Kueue cannot be downloaded here, so its CRDs are written from its API types
(tests/realapi/kueue_crds.py), its Workload webhook and CEL rules are enforced by the lane's
admission server (tests/realapi/admission.py), and this plays its controllers, writing only what
they write (through the API server, so those checks see every write) and leaving every step the
job integration owns to the operator (never clearing an admission itself). Written from
kubernetes-sigs/kueue, main as of 2026-08. One ClusterQueue with a quota of `quota` pods
(Kueue's `pods` resource) on one ResourceFlavor, BestEffortFIFO, preemption
`withinClusterQueue: LowerPriority`. Each `step` does, in Kueue's order:

- the workload controller (pkg/controller/core/workload_controller.go): a Workload with
  `spec.active: false` that holds quota is evicted (Evicted, reason Deactivated); with
  `pods_ready_timeout` (waitForPodsReady), one admitted without PodsReady True is timed by its
  PodsReady reason as admittedNotReadyWorkload does: none, WaitForStart (or the old PodsReady)
  from its Admitted condition's transition against `timeout`, WaitForRecovery from PodsReady's
  transition against `recovery_timeout` only (none: never timed out); once timed out it is
  evicted (PodsReadyTimeout) with its requeue state counted up and its requeueAt set to now plus
  the backoff (pkg/workload/workload.go, UpdateRequeueState: base x 2^(n-1), at most
  `backoff_max`); past `backoff_limit` requeues it is deactivated instead (triggerDeactivation).
  An evicted Workload back in its queue (Requeued False, PodsReadyTimeout) waits out its
  requeueAt, then gets Requeued True, reason BackoffFinished. A Workload being deleted with no
  owner left loses Kueue's finalizer (FinalizeOrphanedWorkload).
- the scheduler (pkg/scheduler/scheduler.go), Workloads without quota by priority then age,
  none still in its backoff: a workload slice (annotated as the replacement of one that holds
  quota: pkg/workloadslicing) is admitted against the difference only and finishes the one it
  replaces (WorkloadSliceReplaced); any other is admitted whole if it fits, else, when its one
  PodSet with a minCount allows it (PartialAdmission; the webhook allows one), with the largest
  count of that PodSet that fits (the PodSetReducer's search); else lower-priority Workloads are
  evicted (Preempted, with the Preempted condition) until it would fit, and it waits for their
  quota to come back, which only the integration's release does.

Admission writes QuotaReserved and Admitted True, Evicted False where it was True, and the
admission (the ClusterQueue, each PodSet's count and flavor). Quota is counted from what holds
it (QuotaReserved True or an admission), each PodSet at the lower of its admitted count and its
count now (a slice lowered in place gives the difference back: totalRequestsFromAdmission), so
an evicted Workload whose integration never releases it keeps its pods' worth forever, as in
Kueue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from diloco.operator.kube import ApiError, Kube
from diloco.operator.kueue import integration as k
from diloco.operator.status.conditions import find

SLICE_OF = "kueue.x-k8s.io/workload-slice-replacement-for"
FINALIZER = "kueue.x-k8s.io/resource-in-use"


def stamp(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str | None) -> datetime | None:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) if text else None


def _cond(type_: str, status: bool, reason: str, message: str, *, now: str, generation: int) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": now, "observedGeneration": generation}


def _set(conds: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """apimeta.SetStatusCondition: the transition time kept where the status did not change."""
    old = next((c for c in conds if c["type"] == new["type"]), None)
    if old is not None and old.get("status") == new["status"]:
        new = {**new, "lastTransitionTime": old.get("lastTransitionTime") or new["lastTransitionTime"]}
    return [c for c in conds if c["type"] != new["type"]] + [new]


def _conds(wl: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((wl.get("status") or {}).get("conditions") or [])


def _gen(wl: Mapping[str, Any]) -> int:
    return int((wl.get("metadata") or {}).get("generation") or 0)


def counts(wl: Mapping[str, Any]) -> dict[str, int]:
    return {p.get("name", "main"): int(p["count"]) for p in wl["spec"]["podSets"]}


def held(wl: Mapping[str, Any]) -> int:
    """Pods of quota the Workload holds: each PodSet's admitted count, or its count now if lower."""
    if not (k.holds_quota(wl) and not k.finished(wl)):
        return 0
    now = counts(wl)
    return sum(min(int(a.get("count", 0)), now.get(a["name"], 0))
               for a in ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or [])


# --- Kueue's status writes, pure -------------------------------------------------------------------

def admitted(wl: Mapping[str, Any], given: Mapping[str, int], *, cluster_queue: str, flavor: str,
             now: str) -> dict[str, Any]:
    """The scheduler's admission: QuotaReserved and Admitted True (no admission checks), Evicted
    and Preempted False where they were True, and the admission."""
    gen = _gen(wl)
    conds = _set(_set(_conds(wl), _cond("QuotaReserved", True, "QuotaReserved",
                                        f"Quota reserved in ClusterQueue {cluster_queue}", now=now, generation=gen)),
                 _cond("Admitted", True, "Admitted", "The workload is admitted", now=now, generation=gen))
    if k.evicted(wl):
        conds = _set(conds, _cond("Evicted", False, "QuotaReserved", "Previously: evicted", now=now, generation=gen))
    if (find(conds, "Preempted") or {}).get("status") == "True":
        conds = _set(conds, _cond("Preempted", False, "QuotaReserved", "Previously: preempted", now=now,
                                  generation=gen))
    assignments = [{"name": name, "count": count, "flavors": {"pods": flavor}, "resourceUsage": {"pods": str(count)}}
                   for name, count in given.items()]
    return {"conditions": conds, "admission": {"clusterQueue": cluster_queue, "podSetAssignments": assignments}}


def evicted(wl: Mapping[str, Any], reason: str, message: str, *, now: str,
            requeue: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """workloadevict.Evict: the Evicted condition (Preempted too for a preemption), the requeue
    state where the eviction counts one (PodsReadyTimeout)."""
    gen = _gen(wl)
    conds = _set(_conds(wl), _cond("Evicted", True, reason, message, now=now, generation=gen))
    if reason == "Preempted":
        conds = _set(conds, _cond("Preempted", True, "InClusterQueue", message, now=now, generation=gen))
    return {"conditions": conds, **({"requeueState": dict(requeue)} if requeue is not None else {})}


def finished(wl: Mapping[str, Any], reason: str, message: str, *, now: str) -> dict[str, Any]:
    return {"conditions": _set(_conds(wl), _cond("Finished", True, reason, message, now=now, generation=_gen(wl)))}


def requeue_state(wl: Mapping[str, Any], *, base: float, most: float, now: datetime) -> dict[str, Any]:
    """UpdateRequeueState: the count up by one, requeueAt now + base x 2^(count-1), at most `most`
    (wait.Backoff's jitter, 0.0001, left out)."""
    count = int(((wl.get("status") or {}).get("requeueState") or {}).get("count") or 0) + 1
    wait = min(base * 2 ** (count - 1), most)
    return {"count": count, "requeueAt": stamp(now + timedelta(seconds=wait))}


def not_ready_deadline(wl: Mapping[str, Any], *, timeout: float,
                       recovery_timeout: float | None) -> tuple[str, datetime] | None:
    """admittedNotReadyWorkload: (the PodsReady reason that is timed, when it times out), or None
    when nothing is timed (not admitted, PodsReady True, WaitForRecovery with no recoveryTimeout)."""
    conds = _conds(wl)
    if (find(conds, "Admitted") or {}).get("status") != "True":
        return None
    ready = find(conds, "PodsReady")
    if ready is not None and ready.get("status") == "True":
        return None
    if ready is None or ready.get("reason") in ("WaitForStart", "PodsReady"):
        since = _parse((find(conds, "Admitted") or {}).get("lastTransitionTime"))
        return ("WaitForStart", since + timedelta(seconds=timeout)) if since else None
    if ready.get("reason") == "WaitForRecovery" and recovery_timeout is not None:
        since = _parse(ready.get("lastTransitionTime"))
        return ("WaitForRecovery", since + timedelta(seconds=recovery_timeout)) if since else None
    return None


def fit(wl: Mapping[str, Any], free: int) -> dict[str, int] | None:
    """Whole, else partial admission: the one PodSet with a minCount at the largest count that fits,
    never under its minCount (PodSetReducer); None when neither fits."""
    full = counts(wl)
    if sum(full.values()) <= free:
        return full
    flexible = [p for p in wl["spec"]["podSets"] if p.get("minCount") is not None and p["minCount"] < p["count"]]
    if len(flexible) != 1:  # the webhook allows one; none: all or nothing
        return None
    name, lowest = flexible[0].get("name", "main"), int(flexible[0]["minCount"])
    room = free - (sum(full.values()) - full[name])
    return {**full, name: room} if room >= lowest else None


class Kueue:
    def __init__(self, api: Kube, namespace: str, *, quota: int, cluster_queue: str, flavor: str,
                 pods_ready_timeout: float | None = None, recovery_timeout: float | None = None,
                 backoff_base: float = 60.0, backoff_max: float = 3600.0, backoff_limit: int | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.api, self.namespace, self.quota = api, namespace, quota
        self.cluster_queue, self.flavor = cluster_queue, flavor
        self.pods_ready_timeout, self.recovery_timeout = pods_ready_timeout, recovery_timeout
        self.backoff_base, self.backoff_max, self.backoff_limit, self.clock = backoff_base, backoff_max, \
            backoff_limit, clock
        self.log: list[tuple[str, str]] = []  # (what, Workload name), in order
        self.refused: list[str] = []  # writes of its own the API server refused (the double must never be)

    def workloads(self) -> list[dict[str, Any]]:
        return self.api.list("Workload", self.namespace)

    def _status(self, wl: Mapping[str, Any], status: dict[str, Any]) -> bool:
        md = wl["metadata"]
        try:
            self.api.patch("Workload", md["namespace"], md["name"],
                           {"metadata": {"resourceVersion": md["resourceVersion"]}, "status": status}, sub="status")
        except ApiError as exc:
            if exc.status in (404, 409):  # changed meanwhile: the next step sees it again
                return False
            self.refused.append(f"{md['name']}: {exc.detail}")
            raise
        return True

    def evict(self, wl: Mapping[str, Any], reason: str, message: str,
              requeue: Mapping[str, Any] | None = None) -> None:
        if self._status(wl, evicted(wl, reason, message, now=stamp(self.clock()), requeue=requeue)):
            self.log.append((f"evicted:{reason}", wl["metadata"]["name"]))

    def admit(self, wl: Mapping[str, Any], given: dict[str, int]) -> bool:
        status = admitted(wl, given, cluster_queue=self.cluster_queue, flavor=self.flavor, now=stamp(self.clock()))
        if self._status(wl, status):
            self.log.append((f"admitted:{sum(given.values())}", wl["metadata"]["name"]))
            return True
        return False

    def finish(self, wl: Mapping[str, Any], reason: str, message: str) -> None:
        if self._status(wl, finished(wl, reason, message, now=stamp(self.clock()))):
            self.log.append((f"finished:{reason}", wl["metadata"]["name"]))

    def _controller(self, wl: dict[str, Any]) -> None:
        """One Workload's pass through the workload controller."""
        md, now = wl["metadata"], self.clock()
        if md.get("deletionTimestamp"):
            if not md.get("ownerReferences") and FINALIZER in (md.get("finalizers") or []):
                try:
                    self.api.patch("Workload", md["namespace"], md["name"], {"metadata": {
                        "resourceVersion": md["resourceVersion"],
                        "finalizers": [f for f in md["finalizers"] if f != FINALIZER]}})
                except ApiError as exc:
                    if exc.status not in (404, 409):
                        raise
                    return
                self.log.append(("finalized:orphan", md["name"]))
            return
        if k.finished(wl):
            return
        status = wl.get("status") or {}
        requeued = find(_conds(wl), "Requeued")
        if not k.holds_quota(wl):
            at = _parse((status.get("requeueState") or {}).get("requeueAt"))
            if requeued is not None and requeued.get("status") == "False" and \
                    requeued.get("reason") == "PodsReadyTimeout" and (at is None or at <= now):
                gen = _gen(wl)
                conds = _set(_conds(wl), _cond("Requeued", True, "BackoffFinished", "The workload backoff was finished",
                                               now=stamp(now), generation=gen))
                if self._status(wl, {"conditions": conds, "requeueState": {**(status.get("requeueState") or {}),
                                                                           "requeueAt": None}}):
                    self.log.append(("backoff-finished", md["name"]))
            return
        if k.evicted(wl):
            return
        if wl["spec"].get("active") is False:
            self.evict(wl, "Deactivated", "The workload is deactivated")
        elif self.pods_ready_timeout is not None:
            due = not_ready_deadline(wl, timeout=self.pods_ready_timeout, recovery_timeout=self.recovery_timeout)
            if due is not None and now >= due[1]:
                count = int((status.get("requeueState") or {}).get("count") or 0)
                if self.backoff_limit is not None and count + 1 > self.backoff_limit:
                    self.api.patch("Workload", md["namespace"], md["name"], {"spec": {"active": False}})
                    self.log.append(("deactivated:RequeuingLimitExceeded", md["name"]))
                    return
                self.evict(wl, "PodsReadyTimeout", f"Exceeded the PodsReady timeout {md['namespace']}/{md['name']}",
                           requeue_state(wl, base=self.backoff_base, most=self.backoff_max, now=now))
                self.log[-1] = (f"evicted:PodsReadyTimeout:{due[0]}", md["name"])

    def _waiting(self, wl: Mapping[str, Any]) -> bool:
        """In the queue: no quota, not finished, active, not being deleted, its backoff over."""
        if k.holds_quota(wl) or k.finished(wl) or wl["spec"].get("active") is False or \
                wl["metadata"].get("deletionTimestamp"):
            return False
        at = _parse(((wl.get("status") or {}).get("requeueState") or {}).get("requeueAt"))
        return at is None or at <= self.clock()

    def step(self) -> None:
        for wl in self.workloads():
            self._controller(wl)
        wls = [w for w in self.workloads() if not w["metadata"].get("deletionTimestamp")]
        by_key = {f"{w['metadata']['namespace']}/{w['metadata']['name']}": w for w in wls}
        free = self.quota - sum(held(w) for w in wls)
        pending = sorted((w for w in wls if self._waiting(w)),
                         key=lambda w: (-int(w["spec"].get("priority") or 0), w["metadata"]["creationTimestamp"]))
        for wl in pending:  # the scheduler
            want = counts(wl)
            replaced = by_key.get((wl["metadata"].get("annotations") or {}).get(SLICE_OF, ""))
            if replaced is not None and k.holds_quota(replaced) and not k.finished(replaced) and \
                    not k.evicted(replaced):
                if sum(want.values()) - held(replaced) <= free and self.admit(wl, want):
                    free -= sum(want.values()) - held(replaced)
                    self.finish(replaced, "WorkloadSliceReplaced",
                                f"Replaced to accommodate a workload (UID: {wl['metadata']['uid']}, JobUID: "
                                f"{(wl['metadata'].get('labels') or {}).get(k.JOB_UID_LABEL, '')}) due to "
                                "workload slice aggregation")
                continue
            given = fit(wl, free)
            if given is not None:
                if self.admit(wl, given):
                    free -= sum(given.values())
                continue
            self._preempt_for(wl, free, wls)

    def _preempt_for(self, wl: dict[str, Any], free: int, wls: list[dict[str, Any]]) -> None:
        """Evict lower-priority holders, lowest first and newest first, if that makes it fit."""
        priority, need = int(wl["spec"].get("priority") or 0), sum(counts(wl).values())
        minimum = sum(int(p.get("minCount", p["count"])) for p in wl["spec"]["podSets"])
        victims = sorted((w for w in wls if held(w) and not k.evicted(w)
                          and int(w["spec"].get("priority") or 0) < priority),
                         key=lambda w: w["metadata"]["creationTimestamp"], reverse=True)  # newest first
        victims.sort(key=lambda w: int(w["spec"].get("priority") or 0))  # then the lowest priority first
        chosen, freed = [], 0
        for v in victims:
            if free + freed >= min(need, minimum):
                break
            chosen.append(v)
            freed += held(v)
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
        assert not self.refused, f"the API server refused the Kueue double's own writes: {self.refused}"

