"""Every Workload the operator writes is one Kueue accepts (issue 61).

For every example, queued as written and with `minReplicas` added to its groups, a job's whole
life under Kueue is played: the first Workload created, admitted (in part where it may be), the
slice that grows it, Kueue admitting the slice and finishing the one it replaces, the job
shrinking in place, PodsReady, an eviction and the quota given back, and the end. Each write,
the operator's and Kueue's alike, is checked as Kueue checks it: its CRD's schema and CEL rules
and its Workload webhook (tests/realapi/kueue_crds.py, tests/realapi/cel.py,
tests/realapi/kueue_webhook.py, each cited to Kueue's source), in both API versions. The
double's refusals are shown to bite in tests/operator/kueue/test_kueue_double.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import lifecycle, priorities, queueing, slices
from diloco.operator.render import access
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.spec import DecoupledDiLoCoJob, home_view, parse_job
from tests.realapi import kueue as double
from tests.realapi.kueue_crds import refusals

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
NOW = "2027-01-15T08:00:00Z"
LATER = "2027-01-15T08:05:00Z"


def variants(example: str) -> list[tuple[str, dict[str, Any]]]:
    """The example queued as written; with minReplicas on its first single-host group (raised to
    4 replicas where it had fewer, so part of it can be admitted); and on every single-host group."""
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())
    raw["metadata"].setdefault("labels", {})[kueue.QUEUE_LABEL] = "training"
    out = [("as written", raw)]
    single = [i for i, g in enumerate(raw["spec"]["learnerGroups"]) if int(g.get("hostsPerLearner", 1)) == 1]
    if not single:
        return out
    one = copy.deepcopy(raw)
    g = one["spec"]["learnerGroups"][single[0]]
    g["replicas"] = max(int(g.get("replicas", 1)), 4)
    g["minReplicas"] = max(1, g["replicas"] // 4)
    out.append(("minReplicas on one group", one))
    every = copy.deepcopy(raw)
    for i in single:
        g = every["spec"]["learnerGroups"][i]
        g["replicas"] = max(int(g.get("replicas", 1)), 3)
        g["minReplicas"] = 1
    out.append(("minReplicas on every group", every))
    if "external" not in raw["spec"].get("syncer", {}):  # a standby per shard: Kueue reserves two syncer pods each
        standby = copy.deepcopy(one)
        standby["spec"]["syncer"].update(standby={}, checkpoints={"url": f"s3://checkpoints/{example}"})
        out.append(("minReplicas on one group and a standby", standby))
    return out


def three_groups() -> dict[str, Any]:
    """Three elastic groups in one cluster (examples/multicluster.yaml's, all run here): the first
    Workload's other groups ask for their minimum, so it grows by a slice after it is queued again
    under a slice's name (which once collided with the grow slice's) and its job finishes with that
    slice still queued (which must go, not wait for quota it would never use)."""
    raw = yaml.safe_load((ROOT / "examples" / "multicluster.yaml").read_text())
    raw["metadata"].setdefault("labels", {})[kueue.QUEUE_LABEL] = "training"
    raw["spec"].pop("clusters")
    raw["spec"]["syncer"].pop("expose")
    for g in raw["spec"]["learnerGroups"]:
        g.pop("cluster", None)
        g["minReplicas"] = 1
    return raw


# Every variant in v1beta2 (the version current Kueue stores); in v1beta1 (Kueue before 0.15),
# which differs only in how the priority class is named, the variant that takes every path.
CASES = [(example, name, raw, version) for example in EXAMPLES for name, raw in variants(example)
         for version in ("v1beta2", "v1beta1") if version == "v1beta2" or name == "minReplicas on every group"]
CASES += [("multicluster.yaml", "three groups here, minReplicas on every group", three_groups(), "v1beta2")]
pytestmark = pytest.mark.slow  # about 0.3 s each: the CEL rules evaluated in Python over whole Workloads


class Server:
    """What the API server and Kueue's checks make of each write: refusals collected, the object
    as stored (server-side apply of the operator's Workloads, merge of status writes)."""

    def __init__(self, version: str) -> None:
        self.version, self.stored, self.refused, self.rv = version, {}, [], 0

    def _check(self, new: dict[str, Any], old: dict[str, Any] | None, what: str) -> None:
        for problem in refusals(new, old, self.version):
            self.refused.append(f"{what} {new['metadata']['name']}: {problem}")

    def apply(self, desired: dict[str, Any], created: str) -> dict[str, Any]:
        name, old = desired["metadata"]["name"], self.stored.get(desired["metadata"]["name"])
        self.rv += 1
        if old is None:
            new = copy.deepcopy(desired)
            new["metadata"].update(uid=f"uid-{name}", creationTimestamp=created, resourceVersion=str(self.rv),
                                   generation=1)
        else:  # server-side apply: what the operator sets replaced (it alone writes these fields), the rest kept
            new = {**copy.deepcopy(old), "spec": copy.deepcopy(desired["spec"])}
            new["metadata"] = {**{k: v for k, v in old["metadata"].items()
                                  if k not in ("labels", "annotations", "finalizers")},
                               **copy.deepcopy(desired["metadata"]), "resourceVersion": str(self.rv),
                               "generation": old["metadata"]["generation"] + (old["spec"] != desired["spec"])}
        self._check(new, old, "apply")
        self.stored[name] = new
        return new

    def status(self, wl: dict[str, Any], status: dict[str, Any], who: str) -> dict[str, Any]:
        old = self.stored[wl["metadata"]["name"]]
        merged = {**old.get("status", {}), **status}
        new = {**copy.deepcopy(old), "status": {k: v for k, v in merged.items() if v is not None}}
        self.rv += 1
        new["metadata"] = {**new["metadata"], "resourceVersion": str(self.rv)}
        self._check(new, old, f"{who}'s status write on")
        self.stored[wl["metadata"]["name"]] = new
        return new

    def let_go(self, wl: dict[str, Any]) -> None:
        old = self.stored[wl["metadata"]["name"]]
        new = copy.deepcopy(old)
        new["metadata"]["finalizers"] = [f for f in old["metadata"].get("finalizers") or [] if f != kueue.FINALIZER]
        self._check(new, old, "finalizer removal on")
        self.stored[wl["metadata"]["name"]] = new

    def delete(self, name: str) -> None:
        self.stored.pop(name, None)

    def live(self) -> dict[tuple[str, str], Any]:
        return {(kueue.KIND, name): wl for name, wl in self.stored.items()}


def decide(job: DecoupledDiLoCoJob, server: Server, *, owner: render.Owner, stopped: bool = True,
           finished: bool = False) -> queueing.Queued:
    seen = queueing.Seen(server.version, priority=priorities.Priority("WorkloadPriorityClass", "high", 1000)
                         if priorities.PRIORITY_LABEL in (job.metadata.labels or {}) else None)
    q = queueing.decide(job, seen, owner=owner, link=access.link(job, owner.namespace, {}), queue_name="training",
                        live=server.live(), finished=finished, generation=2, stopped=stopped)
    return q


def converge(job: DecoupledDiLoCoJob, server: Server, owner: render.Owner, when: str, **kw: Any) -> queueing.Queued:
    """One pass of the operator: its Workloads applied, the others of the job deleted."""
    q = decide(job, server, owner=owner, **kw)
    if q.replace is not None:
        server.delete(q.replace["metadata"]["name"])
    for wl in q.let_go:
        server.let_go(wl)
    wanted = {w["metadata"]["name"] for w in q.workloads}
    for w in q.workloads:
        server.apply(w, when)
    for name in list(server.stored):
        if name not in wanted and (kueue.KIND, name) not in q.dropped:
            server.delete(name)
    return q


def pods_for(counts: dict[str, int], ready: bool = True) -> list[dict[str, Any]]:
    out = []
    for pod_set, count in counts.items():
        component = n.SYNCER if pod_set == kueue.SYNCER_POD_SET else n.LEARNER
        for i in range(count):
            out.append({"metadata": {"name": f"{pod_set}-{i}", "labels": {
                n.COMPONENT: component, **({n.GROUP: pod_set} if component == n.LEARNER else {})}},
                "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})
    return out


def settle(q: queueing.Queued, server: Server, pods: list[dict[str, Any]]) -> None:
    for write in queueing.settle(q, pods, finished=False, now=LATER):
        server.status(write.workload, write.status, "the operator")


def shrunk(raw: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for g in out["spec"]["learnerGroups"]:
        if g.get("minReplicas") is not None:
            g["replicas"] = max(int(g["minReplicas"]), int(g["replicas"]) - 1)
    return out


def here(raw: dict[str, Any]) -> DecoupledDiLoCoJob:
    """The job as this cluster's operator runs it: a multi-cluster job's home view (its remote
    groups are queued in their own clusters)."""
    job = parse_job(raw)
    return job.model_copy(update={"spec": home_view(job.spec)})


@pytest.mark.parametrize(("example", "variant", "raw", "version"), CASES, ids=[f"{e}-{v}-{x}" for e, v, _, x in CASES])
def test_every_workload_slice_and_status_write_passes_kueues_checks(example: str, variant: str, raw: dict[str, Any],
                                                                    version: str) -> None:
    job = here(raw)
    owner = render.Owner(job.metadata.name, job.metadata.namespace or "jobs", "7c1b0d9e-1f7e-4a55-9d1c-0d2b8d1c3e11")
    server = Server(version)
    whole = kueue.whole(job)

    q = converge(job, server, owner, NOW)  # queued: the first Workload
    (first,) = server.stored.values()
    assert not q.gate.admitted and first["metadata"]["finalizers"] == [kueue.FINALIZER]
    assert first["metadata"]["labels"][kueue.JOB_UID_LABEL] == owner.uid
    # Kueue admits it: in part where the first Workload allows it (one learner short, never under minCount).
    room = sum(whole.values()) - 1 if kueue.elastic(job) else sum(whole.values())
    given = double.fit(first, room) or double.counts(first)
    first = server.status(first, double.admitted(first, given, cluster_queue="cq", flavor="default", now=NOW),
                          "Kueue")

    q = converge(job, server, owner, NOW)
    assert q.gate.admitted
    settle(q, server, pods_for(q.admitted))  # PodsReady: Started
    if kueue.elastic(job):  # a slice queued for the rest, then admitted against the difference
        (grow,) = [w for w in server.stored.values() if w["metadata"]["name"] != first["metadata"]["name"]]
        assert slices.sliced(grow) and double.counts(grow) == whole
        grow = server.status(grow, double.admitted(grow, double.counts(grow), cluster_queue="cq", flavor="default",
                                                   now=LATER), "Kueue")
        server.status(first, double.finished(first, "WorkloadSliceReplaced", "Replaced", now=LATER), "Kueue")
        q = converge(job, server, owner, LATER)
        assert list(server.stored) == [grow["metadata"]["name"]] and q.admitted == whole
        settle(q, server, pods_for(q.admitted))
        smaller = here(shrunk(raw))  # the job shrinks: the held slice lowered in place
        q = converge(smaller, server, owner, LATER)
        assert list(server.stored) == [grow["metadata"]["name"]] and q.replace is None
        assert double.counts(server.stored[grow["metadata"]["name"]]) == kueue.whole(smaller)
        job = smaller
    held = next(iter(server.stored.values()))
    settle(q, server, pods_for(q.admitted, ready=False)[1:])  # a pod lost: WaitForRecovery
    held = server.status(held, double.evicted(held, "Preempted", "Preempted to accommodate a workload", now=LATER),
                         "Kueue")
    q = converge(job, server, owner, LATER)
    settle(q, server, pods_for(q.admitted)[2:])  # the pods going
    settle(q, server, [])  # gone: the quota given back
    held = server.stored[held["metadata"]["name"]]
    assert not kueue.holds_quota(held)
    assert lifecycle.PODS_READY in {c["type"] for c in held["status"]["conditions"]}
    q = converge(job, server, owner, LATER)  # queued again as its first Workload
    (again,) = server.stored.values()
    again = server.status(again, double.admitted(again, double.counts(again), cluster_queue="cq", flavor="default",
                                                 now=LATER), "Kueue")
    q = converge(job, server, owner, LATER)
    done = lifecycle.finish(again, succeeded=True, message="the job finished", now=LATER)
    assert done is not None
    server.status(again, done, "the operator")
    converge(job, server, owner, LATER, finished=True)  # Finished: Kueue's finalizer let go, nothing new queued
    (last,) = server.stored.values()
    assert not last["metadata"]["finalizers"] and kueue.finished(last)
    assert server.refused == [], "\n".join(server.refused)
