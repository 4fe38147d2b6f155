"""The operator as the Kueue integration, against the real control plane (tests/realapi/).

Kueue itself cannot be downloaded here: its CRDs are stand-ins with Kueue's group, a release's
version (v1beta1 here; tests/realapi/test_kueue_v1beta2.py: v1beta2) and status subresource
(tests/realapi/kueue_crds.py), with Kueue's default flavor, and the test plays
Kueue, admitting and evicting Workloads by writing their status as Kueue's scheduler does
(QuotaReserved and Admitted, an admission naming the ClusterQueue and each PodSet's assignment;
Evicted). Giving the quota back after an eviction is the integration's, so the operator's
(tests/realapi/test_kueue_lifecycle.py plays the rest of Kueue's state machine). The operator
runs as the chart's ServiceAccount with `kueue.enabled=true`; its audit log must hold no 403.
Each test stands alone: a job of its own, queued or admitted by a fixture, so any one runs alone
and in any order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from diloco.operator.kueue import integration as kueue
from diloco.operator.render import naming as n
from diloco.operator.status.conditions import find
from tests.helpers import wait_for
from tests.realapi.cluster import DEFAULT_FLAVOR, JOBS, Cluster, real_cluster
from tests.realapi.kueue_defaults import Defaults
from tests.realapi.test_operator import audit, refused, tiny_job

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
QUEUE, CLUSTER_QUEUE = "training", "cluster-queue"
# A fixture's job has a name of its own: a deleted job's Workload may linger a moment for the
# garbage collector, and a test that finds two Workloads by the job's labels would fail.
SERIAL = itertools.count(1)
# A namespace with a LocalQueue named `default`, and Kueue's default integrations played there
# (tests/realapi/kueue_defaults.py; no kubelet runs its pods).
SHARED = "shared"
DEFAULTS = Defaults(None)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One control plane for the module; after its last test, whatever the order, the chart's RBAC
    refused none of the operator's requests."""
    with real_cluster(tmp_path_factory.mktemp("realapi-kueue"), kueue=True, namespaces=(SHARED,),
                      mutators=DEFAULTS.mutators()) as c:
        DEFAULTS.api = c.admin
        yield c
        assert not refused(c), f"the chart's RBAC refused the operator: {refused(c)}"


def queued_job(name: str, replicas: int = 1, **spec: Any) -> dict[str, Any]:
    job = tiny_job(name, replicas=replicas, **spec)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: QUEUE}
    return job


def workloads(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return cluster.admin.list("Workload", JOBS, n.selector(name))


def job_pods(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return cluster.admin.list("Pod", JOBS, n.selector(name))


def events(cluster: Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    """The Events `reason` about job `name` (not another test's job)."""
    return [e for e in cluster.events(JOBS, reason) if e["involvedObject"]["name"] == name]


def admitted_condition(cluster: Cluster, name: str) -> dict[str, Any]:
    conds = (cluster.job(name).get("status") or {}).get("conditions") or []
    return next((x for x in conds if x["type"] == kueue.JOB_ADMITTED), {})


def _cond(type_: str, status: bool, reason: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": reason,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


def kueue_admits(cluster: Cluster, wl: dict[str, Any], flavor: str = DEFAULT_FLAVOR) -> None:
    """What Kueue's scheduler writes when the Workload fits its ClusterQueue on `flavor` (and,
    re-admitting, it resets Evicted)."""
    assignments = [{"name": p["name"], "count": p["count"], "flavors": {"cpu": flavor}}
                   for p in wl["spec"]["podSets"]]
    conds = [_cond("QuotaReserved", True, "QuotaReserved"), _cond("Admitted", True, "Admitted")]
    if any(x["type"] == "Evicted" for x in (wl.get("status") or {}).get("conditions") or []):
        conds.append(_cond("Evicted", False, "QuotaReserved"))
    cluster.admin.patch("Workload", wl["metadata"]["namespace"], wl["metadata"]["name"],
                        {"status": {"conditions": conds,
                                    "admission": {"clusterQueue": CLUSTER_QUEUE, "podSetAssignments": assignments}}},
                        sub="status")


def kueue_evicts(cluster: Cluster, wl: dict[str, Any]) -> None:
    """Preempted: Evicted first, the admission still held until the job stops."""
    conds = [_cond("QuotaReserved", True, "QuotaReserved"), _cond("Admitted", True, "Admitted"),
             _cond("Evicted", True, "Preempted")]
    cluster.admin.patch("Workload", JOBS, wl["metadata"]["name"], {"status": {"conditions": conds}}, sub="status")


@pytest.fixture
def waiting(cluster: Cluster) -> Iterator[str]:
    """A queued job of its own (one learner, its data split for two, so it may grow), created
    suspended, its Workload waiting for Kueue; deleted after the test."""
    name = f"waiting-{next(SERIAL)}"
    cluster.admin.create(queued_job(name, suspend=True, data={"shards": 2}))
    wait_for(lambda: workloads(cluster, name), timeout=60, what=f"job {name}'s Workload")
    yield name
    cluster.kubectl("delete", "ddj", "-n", JOBS, name, "--ignore-not-found")


@pytest.fixture
def admitted(cluster: Cluster, waiting: str) -> str:
    """The waiting job admitted by Kueue, its learner's and its syncer's pods made."""
    (wl,) = workloads(cluster, waiting)
    kueue_admits(cluster, wl)
    wait_for(lambda: len(job_pods(cluster, waiting)) == 2, timeout=60, what="the learner and the syncer pod")
    return waiting


def test_a_queued_job_gets_a_workload_and_nothing_runs(cluster: Cluster) -> None:
    cluster.admin.create(queued_job("queued", suspend=True, data={"shards": 2}))
    cluster.admin.create(queued_job("eager"))  # not created suspended: the operator suspends it first
    cluster.admin.create(tiny_job("plain", suspend=True))  # no queue label: no Workload
    (wl,) = wait_for(lambda: workloads(cluster, "queued"), timeout=60, what="the queued job's Workload")
    assert wl["spec"]["queueName"] == QUEUE
    assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("local", 1), ("syncer", 1)]
    assert wl["metadata"]["ownerReferences"][0]["uid"] == cluster.job("queued")["metadata"]["uid"]
    waiting = wait_for(lambda: admitted_condition(cluster, "queued"), timeout=30, what="the Admitted condition")
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitingForAdmission")
    assert wl["metadata"]["name"] in waiting["message"] and QUEUE in waiting["message"]
    wait_for(lambda: cluster.job("eager")["spec"].get("suspend") is True, timeout=30,
             what="the unsuspended queued job suspended by the operator")
    cluster.operator.ticks(3)
    assert cluster.job("queued")["status"]["phase"] == "Suspended"
    for name in ("queued", "eager"):
        assert not job_pods(cluster, name) and not cluster.admin.list("StatefulSet", JOBS, n.selector(name)), name
    assert workloads(cluster, "eager") and not workloads(cluster, "plain")
    assert not admitted_condition(cluster, "plain")
    for name in ("queued", "eager", "plain"):
        cluster.kubectl("delete", "ddj", "-n", JOBS, name)


def test_admission_starts_the_job(cluster: Cluster, waiting: str) -> None:
    (wl,) = workloads(cluster, waiting)
    kueue_admits(cluster, wl)
    wait_for(lambda: cluster.job(waiting)["spec"].get("suspend") is False, timeout=30, what="the job un-suspended")
    wait_for(lambda: len(job_pods(cluster, waiting)) == 2, timeout=60, what="the learner and the syncer pod")
    got = wait_for(lambda: (x := admitted_condition(cluster, waiting)).get("status") == "True" and x, timeout=30,
                   what="Admitted True")
    assert got["reason"] == "Admitted" and CLUSTER_QUEUE in got["message"]
    wait_for(lambda: events(cluster, waiting, "Admitted"), timeout=30, what="the Admitted Event")


def test_eviction_suspends_the_job_and_readmission_resumes_it(cluster: Cluster, admitted: str) -> None:
    (wl,) = workloads(cluster, admitted)
    kueue_evicts(cluster, wl)
    wait_for(lambda: cluster.job(admitted)["spec"].get("suspend") is True, timeout=30, what="the evicted job suspended")
    wait_for(lambda: not job_pods(cluster, admitted), timeout=60, what="every pod of the evicted job gone")
    # The operator, as the integration, gives the quota back once the pods are gone (Kueue does not).
    wait_for(lambda: not kueue.holds_quota(workloads(cluster, admitted)[0]), timeout=30, what="the quota released")
    wait_for(lambda: admitted_condition(cluster, admitted).get("reason") == "Requeued", timeout=30,
             what="the job's Admitted condition saying Requeued")
    cluster.operator.ticks(2)
    assert cluster.job(admitted)["spec"]["suspend"] is True and not job_pods(cluster, admitted)
    (wl,) = workloads(cluster, admitted)
    kueue_admits(cluster, wl)
    wait_for(lambda: len(job_pods(cluster, admitted)) == 2, timeout=60, what="the re-admitted job's pods")


def test_more_learners_replace_the_held_workload(cluster: Cluster, admitted: str) -> None:
    (old,) = workloads(cluster, admitted)
    assert old["metadata"]["finalizers"] == [kueue.FINALIZER] and \
        old["metadata"]["labels"][kueue.JOB_UID_LABEL] == cluster.job(admitted)["metadata"]["uid"]
    cluster.admin.patch("DecoupledDiLoCoJob", JOBS, admitted,
                        {"spec": {"learnerGroups": [{"name": "local", "replicas": 2}]}})
    samples: list[tuple[bool, int]] = []  # (the old Workload still there, the job's pods), every 50 ms

    def replaced() -> list[dict[str, Any]]:
        now = workloads(cluster, admitted)
        samples.append((any(w["metadata"]["uid"] == old["metadata"]["uid"] for w in now),
                        len(job_pods(cluster, admitted))))
        return [w for w in now if w["metadata"]["uid"] != old["metadata"]["uid"]]

    new = wait_for(replaced, timeout=60, period=0.05, what="the Workload replaced")
    # Fix 4: the held Workload (and its quota) goes only once the job's pods are gone.
    assert not [s for s in samples if not s[0] and s[1]], samples
    assert [(p["name"], p["count"]) for p in new[0]["spec"]["podSets"]] == [("local", 2), ("syncer", 1)]
    wait_for(lambda: cluster.job(admitted)["spec"].get("suspend") is True, timeout=30,
             what="the job suspended until the new Workload is admitted")
    wait_for(lambda: not job_pods(cluster, admitted), timeout=60, what="its pods gone meanwhile")
    wait_for(lambda: events(cluster, admitted, "WorkloadReplaced"), timeout=30, what="the WorkloadReplaced Event")
    kueue_admits(cluster, new[0])
    wait_for(lambda: len(job_pods(cluster, admitted)) == 3, timeout=60, what="two learners and the syncer")


def test_a_finished_job_frees_its_quota(cluster: Cluster) -> None:
    job = queued_job("doomed", runPolicy={"backoffLimit": 0})
    job["spec"]["learnerGroups"][0]["image"] = "registry.invalid/no-such-learner:0"
    cluster.kubelet.pullable = lambda image: "no-such" not in image
    cluster.admin.create(job)
    (wl,) = wait_for(lambda: workloads(cluster, "doomed"), timeout=60, what="its Workload")
    kueue_admits(cluster, wl)
    wait_for(lambda: (cluster.job("doomed").get("status") or {}).get("phase") == "Failed", timeout=90,
             what="the job failed for its unpullable image")
    done = wait_for(lambda: [w for w in workloads(cluster, "doomed") if kueue.finished(w)], timeout=30,
                    what="the Workload Finished")
    conds = {x["type"]: x for x in done[0]["status"]["conditions"]}
    assert conds["Finished"]["reason"] == "Failed" and conds["Admitted"]["status"] == "True"  # Kueue's kept
    cluster.kubectl("delete", "ddj", "-n", JOBS, "doomed")


def test_rbac_no_refusal_and_every_kueue_verb_used(cluster: Cluster, admitted: str) -> None:
    """The chart's Workload rules were enough, and each was needed: after a scenario of its own
    that uses each (so it holds run alone or first), besides whatever ran before it: a Workload
    created and applied, replaced when the admitted job grows (its delete), and the new one's
    quota given back after an eviction (its status)."""
    (old,) = workloads(cluster, admitted)
    cluster.admin.patch("DecoupledDiLoCoJob", JOBS, admitted,
                        {"spec": {"learnerGroups": [{"name": "local", "replicas": 2}]}})
    (new,) = wait_for(lambda: [w for w in workloads(cluster, admitted) if w["metadata"]["uid"] != old["metadata"]["uid"]],
                      timeout=60, what="the Workload replaced")
    kueue_admits(cluster, new)
    wait_for(lambda: len(job_pods(cluster, admitted)) == 3, timeout=60, what="two learners and the syncer")
    kueue_evicts(cluster, new)
    wait_for(lambda: [w for w in workloads(cluster, admitted) if w["metadata"]["uid"] == new["metadata"]["uid"]
                      and not kueue.holds_quota(w)], timeout=60, what="the quota released")
    ours = audit(cluster)
    assert not refused(cluster), f"the chart's RBAC refused the operator: {refused(cluster)}"
    used = set()
    for e in ours:
        ref = e.get("objectRef") or {}
        if ref.get("apiGroup") != "kueue.x-k8s.io":
            continue
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((resource, e["verb"]))
        if e["verb"] == "patch" and e.get("responseStatus", {}).get("code") == 201:
            used.add((resource, "create"))  # a server-side apply that created
    assert used >= {("workloads", "list"), ("workloads", "watch"), ("workloads", "create"), ("workloads", "patch"),
                    ("workloads", "delete"), ("workloads/status", "patch")}, used


def test_kueues_default_integrations_leave_the_operators_children_or_the_job_names_the_setting(
        cluster: Cluster) -> None:
    """Issue 61, fix 2, in a namespace with a LocalQueue named `default` and Kueue's statefulset and
    deployment webhooks' defaulting played as they do it: with the job's kind in Kueue's
    integrations.externalFrameworks its StatefulSet and Deployment are left alone (no second
    Workload); without it Kueue labels them and makes a Workload of its own for each, and the job's
    KueueDefaulted condition names the setting."""
    cluster.admin.request("POST", f"apis/kueue.x-k8s.io/v1beta1/namespaces/{SHARED}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue", "metadata": {"name": "default"},
        "spec": {"clusterQueue": CLUSTER_QUEUE}})

    def admitted_children(name: str) -> list[dict[str, Any]]:
        job = queued_job(name, replicas=1)
        job["metadata"]["namespace"] = SHARED
        cluster.admin.create(job)
        (wl,) = wait_for(lambda: cluster.admin.list("Workload", SHARED, n.selector(name)), timeout=60,
                         what=f"{name}'s Workload")
        kueue_admits(cluster, wl)
        return wait_for(lambda: (x := [*cluster.admin.list("StatefulSet", SHARED, n.selector(name)),
                                       *cluster.admin.list("Deployment", SHARED, n.selector(name))]) and len(x) == 2
                        and x, timeout=60, what=f"{name}'s StatefulSet and Deployment")

    DEFAULTS.external_frameworks = {kueue.EXTERNAL_FRAMEWORK}
    try:
        kept = admitted_children("kept")
        assert not [c for c in kept if kueue.QUEUE_LABEL in (c["metadata"].get("labels") or {})], kept
        assert DEFAULTS.step(SHARED) == []  # no second Workload
        assert not find(cluster.job("kept", SHARED)["status"]["conditions"], kueue.DEFAULTED)
    finally:
        DEFAULTS.external_frameworks = set()
    taken = admitted_children("taken")
    assert all(c["metadata"]["labels"][kueue.QUEUE_LABEL] == "default" for c in taken)
    second = DEFAULTS.step(SHARED)
    assert sorted(w["metadata"]["name"] for w in second) == sorted(
        f"{c['kind'].lower()}-{c['metadata']['name']}" for c in taken)
    cond = wait_for(lambda: find((cluster.job("taken", SHARED).get("status") or {}).get("conditions") or [],
                                 kueue.DEFAULTED), timeout=30, what="the job's KueueDefaulted condition")
    assert cond["status"] == "True" and kueue.EXTERNAL_FRAMEWORK in cond["message"], cond
    assert "integrations.externalFrameworks" in cond["message"]
    wait_for(lambda: [e for e in cluster.events(SHARED, kueue.DEFAULTED) if e["involvedObject"]["name"] == "taken"],
             timeout=30, what="the KueueDefaulted Event")
    cluster.kubectl("delete", "ddj", "-n", SHARED, "kept", "taken")
