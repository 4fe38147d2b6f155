"""A Kueue that serves kueue.x-k8s.io/v1beta2 only, against the real control plane (tests/realapi/).

Like tests/realapi/test_kueue.py (a v1beta1 Kueue, played by the test), with stand-ins for
Kueue's CRDs in v1beta2 alone (tests/realapi/kueue_crds.py): the operator finds the
version by discovery and writes the Workload in it, with the WorkloadPriorityClass its label
names; once admitted on a ResourceFlavor, the flavor's node labels and tolerations are in the
pods, and the real scheduler holds them Pending, since the test's node has no such label (nothing
runs: no learner process starts). The operator runs as the chart's ServiceAccount with
`kueue.enabled=true`: reading the cluster-scoped flavor and priority class is allowed by the
chart's ClusterRole for them, and its audit log holds no 403. Each test stands alone (a job of
its own), so either runs alone and in any order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from diloco.operator.kube import ApiError
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import priorities
from diloco.operator.render import naming as n
from tests.helpers import wait_for
from tests.realapi.cluster import JOBS, Cluster, real_cluster
from tests.realapi.test_kueue import QUEUE, admitted_condition, job_pods, kueue_admits, kueue_evicts, workloads
from tests.realapi.test_operator import audit, refused, tiny_job

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
GPU_POOL = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "cloud.google.com/gke-nodepool": "h100"}
GPU_TAINT = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One control plane for the module, the GPU flavor and the priority class made; after its last
    test, whatever the order, the chart's RBAC refused none of the operator's requests."""
    # The status timer every 10 minutes: what the operator does below follows from the events it
    # watches (the job's, its Workloads', its pods'), never from the timer.
    with real_cluster(tmp_path_factory.mktemp("realapi-kueue-v1beta2"), kueue="v1beta2", status_interval=600) as c:
        c.admin.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "h100"},
                        "spec": {"nodeLabels": GPU_POOL, "tolerations": GPU_TAINT}})
        c.admin.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                        "metadata": {"name": "research-high"}, "value": 10000})
        yield c
        assert not refused(c), f"the chart's RBAC refused the operator: {refused(c)}"


def prioritised_job(name: str) -> dict[str, Any]:
    """Two learners, queued with the priority class's label, created suspended."""
    job: dict[str, Any] = tiny_job(name, replicas=2, suspend=True)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: QUEUE, priorities.PRIORITY_LABEL: "research-high"}
    return job


def test_the_workload_is_v1beta2_with_the_priority_and_the_flavor_reaches_the_pods(cluster: Cluster) -> None:
    cluster.admin.create(prioritised_job("flavored"))
    (wl,) = wait_for(lambda: workloads(cluster, "flavored"), timeout=60, what="the job's Workload")
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert wl["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                              "name": "research-high"}
    assert wl["spec"]["priority"] == 10000 and "priorityClassName" not in wl["spec"]
    waiting = wait_for(lambda: admitted_condition(cluster, "flavored"), timeout=30, what="the Admitted condition")
    assert waiting["reason"] == "WaitingForAdmission"
    kueue_admits(cluster, wl, flavor="h100")  # every PodSet on the GPU flavor
    pods = wait_for(lambda: (p := job_pods(cluster, "flavored")) and len(p) == 3 and p, timeout=60,
                    what="the two learners' and the syncer's pods")
    for pod in pods:
        spec = pod["spec"]
        assert {k: spec["nodeSelector"][k] for k in GPU_POOL} == GPU_POOL, pod["metadata"]["name"]
        assert all(t in spec["tolerations"] for t in GPU_TAINT), spec["tolerations"]
        assert pod["metadata"]["labels"][kueue.POD_SET_LABEL] in ("local", "syncer")
        assert not spec.get("nodeName")  # the real scheduler found no node with the flavor's labels
    unschedulable = wait_for(
        lambda: [c for p in job_pods(cluster, "flavored") for c in (p.get("status") or {}).get("conditions") or []
                 if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"],
        timeout=60, what="the scheduler's verdict on the flavored pods")
    assert "node(s) didn't match" in unschedulable[0]["message"] or "node selector" in unschedulable[0]["message"]
    admitted = wait_for(lambda: (x := admitted_condition(cluster, "flavored")).get("status") == "True" and x,
                        timeout=30, what="Admitted True")
    assert admitted["reason"] == "Admitted"
    cluster.kubectl("delete", "ddj", "-n", JOBS, "flavored")
    wait_for(lambda: not cluster.admin.list("StatefulSet", JOBS, n.selector("flavored")), timeout=60,
             what="the job's children gone")


def test_rbac_no_refusal_and_the_cluster_scoped_reads_used(cluster: Cluster) -> None:
    """The chart's rules were enough for a v1beta2 Kueue, flavors and priority classes included:
    after a scenario of its own that reads both (so it holds run alone or first), besides whatever
    ran before it: a job with the priority class's label, admitted on the GPU flavor."""
    cluster.admin.create(prioritised_job("audited"))
    (wl,) = wait_for(lambda: workloads(cluster, "audited"), timeout=60, what="the job's Workload")
    kueue_admits(cluster, wl, flavor="h100")
    wait_for(lambda: (p := job_pods(cluster, "audited")) and all(
        x["spec"].get("nodeSelector", {}).items() >= GPU_POOL.items() for x in p), timeout=60,
        what="the job's pods placed on the flavor's nodes")
    cluster.kubectl("delete", "ddj", "-n", JOBS, "audited")
    ours = audit(cluster)
    assert not refused(cluster), f"the chart's RBAC refused the operator: {refused(cluster)}"
    used = {((e.get("objectRef") or {}).get("resource"), (e.get("objectRef") or {}).get("apiVersion"), e["verb"])
            for e in ours if (e.get("objectRef") or {}).get("apiGroup") == "kueue.x-k8s.io"}
    assert {("resourceflavors", "v1beta2", "get"), ("workloadpriorityclasses", "v1beta2", "get"),
            ("workloads", "v1beta2", "list")} <= used, used
    assert not [u for u in used if u[1] == "v1beta1"]


def _bad(name: str, pod_sets: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": name, "namespace": JOBS, **meta},
            "spec": {"queueName": QUEUE, "podSets": pod_sets}}


def _pod_set(name: str = "main", count: int = 2, **more: Any) -> dict[str, Any]:
    return {"name": name, "count": count, "template": {"spec": {"containers": [{"name": "c", "image": "x"}]}}, **more}


def test_the_strict_double_refuses_what_kueue_refuses(cluster: Cluster) -> None:
    """Issue 61: Kueue's schema (the API server's own check), its CEL rules (the lane's CEL gate,
    tests/realapi/cel.py) and its Workload webhook (tests/realapi/kueue_webhook.py) each refuse a
    hand-made bad Workload written by the admin on the real server; a good one goes through, and
    once it holds quota its PodSets and queue are refused changes. Every rule is tested one by
    one, pure, in tests/operator/kueue/test_kueue_double.py."""
    refusals = {
        "elastic-and-partial": (_bad("elastic-and-partial", [_pod_set(minCount=1)],
                                     annotations={"kueue.x-k8s.io/elastic-job": "true"}),
                                "partial admission and elastic job cannot be used together"),
        "two-min-counts": (_bad("two-min-counts", [_pod_set("a", minCount=1), _pod_set("b", minCount=1)]),
                           "at most one podSet can use minCount"),
        "min-over-count": (_bad("min-over-count", [_pod_set(count=1, minCount=2)]),
                           "minCount should be positive and less or equal to count"),
        "negative-count": (_bad("negative-count", [_pod_set(count=-1)]), "spec.podSets"),
        "reserved-pods": (_bad("reserved-pods", [{"name": "main", "count": 1, "template": {"spec": {"containers": [
            {"name": "c", "image": "x", "resources": {"requests": {"pods": "1"}}}]}}}]),
            "the key is reserved for internal kueue use"),
        "ref-kind": (_bad("ref-kind", [_pod_set()]) | {"spec": {"podSets": [_pod_set()], "priority": 1,
                                                                "priorityClassRef": {"group": "scheduling.k8s.io",
                                                                                     "kind": "WorkloadPriorityClass",
                                                                                     "name": "x"}}},
                     "only the PriorityClass kind is allowed for the scheduling.k8s.io group"),
    }
    for name, (body, words) in refusals.items():
        try:
            cluster.admin.create(body)
        except ApiError as exc:
            assert words in exc.detail, (name, exc.detail)
        else:
            raise AssertionError(f"the API server stored the bad Workload {name}")
    good = cluster.admin.create(_bad("good", [_pod_set()]))
    kueue_admits(cluster, good)
    held = cluster.admin.get("Workload", JOBS, "good")
    changes = {"a PodSet grown": ({"spec": {"podSets": [_pod_set(count=3)]}}, "field is immutable"),
               "the queue": ({"spec": {"queueName": "other"}}, "queueName is immutable while workload quota reserved"),
               "the admission": ({"status": {"admission": {"clusterQueue": "another", "podSetAssignments": [
                   {"name": "main", "count": 2}]}}}, "field is immutable")}
    for what, (patch, words) in changes.items():
        with pytest.raises(ApiError) as refused_change:
            cluster.admin.patch("Workload", JOBS, "good", {**patch, "metadata": {
                "resourceVersion": held["metadata"]["resourceVersion"]}}, sub="status" if "status" in patch else None)
        assert words in refused_change.value.detail, (what, refused_change.value.detail)
    cluster.admin.patch("Workload", JOBS, "good", {"spec": {"podSets": [_pod_set(count=1)]}})  # a count may fall
    assert {r.name for r in cluster.gate.refused} >= {"elastic-and-partial", "two-min-counts", "min-over-count",
                                                      "reserved-pods", "ref-kind", "good"}
    cluster.admin.delete("Workload", JOBS, "good")


def test_kueues_decisions_are_acted_on_within_a_second_through_the_watch(cluster: Cluster) -> None:
    """Issue 61, fix 3: with the status timer at 10 minutes, the operator acts on Kueue's admission
    and eviction as they are written (its watch on the Workloads its jobs own), and gives the
    quota back as the last pod goes (its watch on the jobs' pods). Pods stay Pending (a node
    label no node has), so nothing but the operator's reactions is timed."""
    job = tiny_job("watched", replicas=2, suspend=True)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: QUEUE}
    job["spec"]["learnerGroups"][0]["nodeSelector"] = {"diloco.dev/no-such-node": "true"}
    cluster.admin.create(job)
    (wl,) = wait_for(lambda: workloads(cluster, "watched"), timeout=30, what="the job's Workload")
    start = time.monotonic()
    kueue_admits(cluster, wl)
    wait_for(lambda: cluster.job("watched")["spec"].get("suspend") is False, timeout=30, period=0.02,
             what="the admitted job un-suspended")
    admitted = time.monotonic() - start
    wait_for(lambda: len(job_pods(cluster, "watched")) == 3, timeout=30, what="the job's pods")
    (wl,) = workloads(cluster, "watched")
    start = time.monotonic()
    kueue_evicts(cluster, wl)
    wait_for(lambda: cluster.job("watched")["spec"].get("suspend") is True, timeout=30, period=0.02,
             what="the evicted job suspended")
    evicted = time.monotonic() - start
    wait_for(lambda: not job_pods(cluster, "watched"), timeout=30, period=0.02, what="the evicted job's pods gone")
    start = time.monotonic()
    wait_for(lambda: not kueue.holds_quota(workloads(cluster, "watched")[0]), timeout=30, period=0.02,
             what="the quota given back")
    released = time.monotonic() - start
    print(f"acted on: admission {admitted:.2f} s, eviction {evicted:.2f} s; quota given back {released:.2f} s "
          "after the last pod went (status timer: 600 s)")
    assert max(admitted, evicted, released) < 2.5, (admitted, evicted, released)
    cluster.kubectl("delete", "ddj", "-n", JOBS, "watched")
