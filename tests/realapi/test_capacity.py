"""Capacity waits, refused writes and bad images, against the real control plane (tests/realapi/).

A cluster of its own: a ResourceQuota refusal is a 403 in the audit log, which the RBAC test of
tests/realapi/test_operator.py counts as the chart's RBAC failing. The real kube-scheduler marks pods
Unschedulable (a nodeSelector no node matches) and binds them once the node is labelled; the
real quota admission refuses the learner StatefulSet; the test-side kubelet fails image pulls.
No learner process starts before the last step of the scheduling test: the tests stay light.
Each test stands alone (a job of its own, its Events told apart by the job they name), so any one
runs alone and in any order.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest

from diloco.operator.render import naming as n
from tests.helpers import wait_for
from tests.realapi.cluster import JOBS, Cluster, real_cluster
from tests.realapi.kubelet import NODE
from tests.realapi.test_operator import tiny_job

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
POOL = "diloco.dev/test-pool"  # a node label no node has until the test adds it
QUOTA = "no-statefulsets"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with real_cluster(tmp_path_factory.mktemp("realapi-capacity"), image_pull_grace=5.0) as c:
        yield c


def status(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.job(name).get("status") or {}


def events(cluster: Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    """The Events `reason` about job `name` (not another test's job)."""
    return [e for e in cluster.events(JOBS, reason) if e["involvedObject"]["name"] == name]


def condition(cluster: Cluster, name: str, type_: str) -> dict[str, Any]:
    return next((x for x in status(cluster, name).get("conditions") or [] if x["type"] == type_), {})


def waiting_job(name: str, **spec: Any) -> dict[str, Any]:
    """A job whose learner asks for a node pool no node is in: the scheduler cannot place it."""
    job = tiny_job(name, replicas=1, **spec)
    job["spec"]["learnerGroups"][0]["nodeSelector"] = {POOL: "tpu"}
    return job


def refused_writes(cluster: Cluster, kind: str, reason: str) -> float:
    value = cluster.operator.ctx.metrics.registry.get_sample_value(
        "diloco_operator_child_writes_refused_total", {"kind": kind, "reason": reason})
    return value or 0.0


def quota(cluster: Cluster, statefulsets: int) -> None:
    """The namespace's ResourceQuota on StatefulSets, once the quota controller has counted it."""
    body = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": QUOTA, "namespace": JOBS},
            "spec": {"hard": {"count/statefulsets.apps": str(statefulsets)}}}
    path = f"api/v1/namespaces/{JOBS}/resourcequotas"
    if cluster.admin.request("GET", path, params={"fieldSelector": f"metadata.name={QUOTA}"}).get("items"):
        cluster.admin.request("PATCH", f"{path}/{QUOTA}", {"spec": body["spec"]},
                              content_type="application/merge-patch+json")
    else:
        cluster.admin.request("POST", path, body)
    wait_for(lambda: ((cluster.admin.request("GET", f"{path}/{QUOTA}").get("status") or {}).get("hard") or {})
             .get("count/statefulsets.apps") == str(statefulsets), timeout=30, what="the quota counted")


def test_a_quota_that_refuses_the_learners_shows_and_the_job_recovers_when_raised(cluster: Cluster) -> None:
    quota(cluster, 0)
    cluster.admin.create(waiting_job("quota"))
    refused = wait_for(lambda: (x := condition(cluster, "quota", "ChildrenRefused")).get("status") == "True" and x,
                       timeout=60, what="condition ChildrenRefused")
    assert refused["reason"] == "QuotaExceeded" and "StatefulSet quota-local: create refused" in refused["message"]
    assert f"exceeded quota: {QUOTA}" in refused["message"] and "raise the namespace's ResourceQuota" in \
        refused["message"]
    # The other children were written, the pass did not fail, and the job stays Pending.
    assert cluster.admin.get("Deployment", JOBS, n.syncer("quota")) is not None
    assert cluster.admin.get("ConfigMap", JOBS, n.config_map("quota")) is not None
    assert status(cluster, "quota")["phase"] == "Pending" and cluster.operator.reconciles("error") == 0
    [event] = wait_for(lambda: events(cluster, "quota", "QuotaExceeded"), timeout=30, what="the QuotaExceeded Event")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "quota"
    assert f"exceeded quota: {QUOTA}" in event["message"]
    assert refused_writes(cluster, "StatefulSet", "QuotaExceeded") >= 1
    cluster.operator.ticks(2)  # refused again on every pass: counted, but one Event
    assert len(events(cluster, "quota", "QuotaExceeded")) == 1 and refused_writes(cluster, "StatefulSet",
                                                                              "QuotaExceeded") >= 3
    quota(cluster, 10)
    cleared = wait_for(lambda: (x := condition(cluster, "quota", "ChildrenRefused")).get("status") == "False" and x,
                       timeout=60, what="the condition cleared once the quota allows the StatefulSet")
    assert cleared["reason"] == "ChildrenWritten"
    assert cluster.admin.get("StatefulSet", JOBS, n.statefulset("quota", "local")) is not None
    cluster.kubectl("delete", "ddj", "-n", JOBS, "quota")
    cluster.kubectl("delete", "resourcequota", "-n", JOBS, QUOTA)


POD_QUOTA = "learner-pods"


def pod_quota(cluster: Cluster, pods: int) -> None:
    """The namespace's ResourceQuota on pods, as real clusters set one, once the quota controller
    has counted the pods that run (admission refuses while its usage is unknown)."""
    path = f"api/v1/namespaces/{JOBS}/resourcequotas"
    spec = {"hard": {"pods": str(pods)}}
    if cluster.admin.request("GET", path, params={"fieldSelector": f"metadata.name={POD_QUOTA}"}).get("items"):
        cluster.admin.request("PATCH", f"{path}/{POD_QUOTA}", {"spec": spec}, content_type="application/merge-patch+json")
    else:
        cluster.admin.request("POST", path, {"apiVersion": "v1", "kind": "ResourceQuota",
                                             "metadata": {"name": POD_QUOTA, "namespace": JOBS}, "spec": spec})

    def counted() -> bool:
        got = cluster.admin.request("GET", f"{path}/{POD_QUOTA}").get("status") or {}
        return (got.get("hard") or {}).get("pods") == str(pods) and "pods" in (got.get("used") or {})

    wait_for(counted, timeout=30, what="the pod quota counted")


@pytest.mark.timeout(480)  # two learners start and join, on a shared core: 3 minutes on 2 busy cores
def test_a_pod_quota_that_refuses_a_learner_shows_and_raising_it_runs_the_job_without_restarts(
        cluster: Cluster) -> None:
    """The quota refuses the learner pod the real StatefulSet controller creates (its FailedCreate
    Event), not anything the operator writes. Measured on 2 busy cores: the refusal shows 1 s
    after the scale-up, the pod is created 2 s after the quota is raised."""
    name, learners = "podquota", n.statefulset("podquota", "local")
    # The quota counts every pod of the namespace: the earlier tests' must be gone.
    wait_for(lambda: not cluster.admin.list("Pod", JOBS), timeout=90, what="no pods left in the namespace")
    cluster.admin.create(tiny_job(name, replicas=1, data={"shards": 2}))  # shards for the learner to come
    try:
        wait_for(lambda: status(cluster, name).get("learners") == "1/1", timeout=150, what="the first learner joined")
        [syncer] = cluster.admin.list("Pod", JOBS, n.selector(name, n.SYNCER))
        first = cluster.admin.get("Pod", JOBS, f"{learners}-0")
        assert first is not None and len(cluster.admin.list("Pod", JOBS)) == 2
        pod_quota(cluster, 2)  # what runs, and no more
        cluster.admin.patch("DecoupledDiLoCoJob", JOBS, name, {"spec": {"learnerGroups": [
            {"name": "local", "replicas": 2}]}})
        try:
            refused = wait_for(lambda: (x := condition(cluster, name, "ChildrenRefused")).get("status") == "True"
                               and x, timeout=60, what="condition ChildrenRefused for the refused learner pod")
        except AssertionError:
            sts = cluster.admin.get("StatefulSet", JOBS, learners) or {}
            seen = [(e["reason"], e["involvedObject"]["kind"], e.get("message")) for e in cluster.admin.request(
                "GET", f"api/v1/namespaces/{JOBS}/events").get("items") or [] if e["reason"].endswith("Create")]
            raise AssertionError(f"StatefulSet {sts.get('spec', {}).get('replicas')} wanted, status "
                                 f"{sts.get('status')}; events {seen}; job {status(cluster, name)}") from None
        assert refused["reason"] == "QuotaExceeded", refused
        assert refused["message"].startswith(f"Pod {learners}-1 of StatefulSet {learners}: create refused "
                                             f"(QuotaExceeded, ResourceQuota {POD_QUOTA}): "), refused
        # The API server's message, as the StatefulSet controller reported it, and the fix.
        assert f'pods "{learners}-1" is forbidden: exceeded quota: {POD_QUOTA}' in refused["message"]
        assert f"fix: raise the namespace's ResourceQuota {POD_QUOTA} (kubectl describe resourcequota {POD_QUOTA})" \
            in refused["message"]

        def told() -> list[dict[str, Any]]:
            return [e for e in cluster.events(JOBS, "QuotaExceeded") if e["involvedObject"]["name"] == name]

        [event] = wait_for(told, timeout=30, what="the QuotaExceeded Event on the job")
        assert event["type"] == "Warning" and f"ResourceQuota {POD_QUOTA}" in event["message"]
        assert refused_writes(cluster, "Pod", "QuotaExceeded") >= 1
        assert status(cluster, name)["phase"] == "Running" and cluster.operator.reconciles("error") == 0
        cluster.operator.ticks(2)  # still refused: counted on every pass, told once
        assert len(told()) == 1 and refused_writes(cluster, "Pod", "QuotaExceeded") >= 3
        pod_quota(cluster, 3)
        wait_for(lambda: cluster.admin.get("Pod", JOBS, f"{learners}-1"), timeout=60,
                 what="the StatefulSet controller creating the second learner once the quota allows it")
        wait_for(lambda: status(cluster, name).get("learners") == "2/2", timeout=240,
                 what="the second learner joined")
        cleared = condition(cluster, name, "ChildrenRefused")
        assert (cleared["status"], cleared["reason"]) == ("False", "ChildrenWritten"), cleared
        # Nothing that ran was restarted.
        [still] = cluster.admin.list("Pod", JOBS, n.selector(name, n.SYNCER))
        assert still["metadata"]["uid"] == syncer["metadata"]["uid"]
        assert (cluster.admin.get("Pod", JOBS, f"{learners}-0") or {})["metadata"]["uid"] == first["metadata"]["uid"]
    finally:
        cluster.kubectl("delete", "ddj", "-n", JOBS, name, "--ignore-not-found")
        cluster.kubectl("delete", "resourcequota", "-n", JOBS, POD_QUOTA, "--ignore-not-found")


def test_a_job_whose_pods_cannot_schedule_stays_pending_then_starts_when_a_node_fits(cluster: Cluster) -> None:
    cluster.admin.create(waiting_job("waits", runPolicy={"backoffLimit": 0}))  # any count would fail it
    learner = f"{n.statefulset('waits', 'local')}-0"

    def scheduled() -> dict[str, Any]:
        pod = cluster.admin.get("Pod", JOBS, learner) or {}
        return next((x for x in (pod.get("status") or {}).get("conditions") or [] if x["type"] == "PodScheduled"), {})

    unplaced = wait_for(lambda: (x := scheduled()).get("reason") == "Unschedulable" and x, timeout=60,
                        what="the scheduler marking the learner Unschedulable")
    # The syncer may wait a moment for its volume first; then the learner is the wait.
    waiting = wait_for(lambda: (x := condition(cluster, "waits", "PodsUnschedulable")).get("status") == "True"
                       and x["message"].startswith(f"pod {learner} (learner local-0) is waiting for capacity") and x,
                       timeout=30, what="condition PodsUnschedulable naming the learner")
    assert waiting["reason"] == "Unschedulable" and unplaced["message"] in waiting["message"]

    def told() -> list[dict[str, Any]]:
        return [e for e in cluster.events(JOBS, "Unschedulable") if f"pod {learner} " in e["message"]]

    [event] = wait_for(told, timeout=30, what="the Unschedulable Event naming the learner")
    assert event["type"] == "Warning" and unplaced["message"] in event["message"]
    # Past the 300 s that used to fail it: the condition as the scheduler keeps it (its
    # lastTransitionTime stays while the pod stays unschedulable), an hour old.
    hour_ago = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.admin.patch("Pod", JOBS, learner, {"status": {"conditions": [{**unplaced, "lastTransitionTime": hour_ago}]}},
                        sub="status")
    wait_for(lambda: f"unschedulable since {hour_ago}" in condition(cluster, "waits", "PodsUnschedulable")["message"],
             timeout=30, what="the operator seeing an hour's wait")
    cluster.operator.ticks(2)
    now = status(cluster, "waits")
    assert now["phase"] == "Pending" and "failures" not in now, now
    # The metrics the PodsUnschedulable alert reads: an hour's wait, and the job's phase.
    labels = {"diloco_namespace": JOBS, "diloco_job": "waits"}
    sample = cluster.operator.ctx.metrics.registry.get_sample_value
    assert sample("diloco_job_unschedulable_pods", labels) == 1
    assert (sample("diloco_job_unschedulable_seconds", labels) or 0) >= 3600
    assert sample("diloco_job_phase", {**labels, "phase": "Pending"}) == 1
    assert condition(cluster, "waits", "Failed")["status"] == "False"
    assert len(told()) == 1
    # A node joins the pool: the scheduler places the learner and the kubelet starts it.
    cluster.kubectl("label", "node", NODE, f"{POOL}=tpu")
    try:
        placed = wait_for(lambda: (x := condition(cluster, "waits", "PodsUnschedulable")).get("status") == "False"
                          and x, timeout=90, what="the learner scheduled")
        assert placed["reason"] == "PodsScheduled"
        wait_for(lambda: ((cluster.admin.get("Pod", JOBS, learner) or {}).get("status") or {}).get("phase")
                 == "Running", timeout=60, what="the learner started on the node")
        assert status(cluster, "waits")["phase"] != "Failed"
    finally:
        cluster.kubectl("delete", "ddj", "-n", JOBS, "waits")
        cluster.kubectl("label", "node", NODE, f"{POOL}-")


def test_a_scheduling_timeout_ends_the_job_failed_naming_it(cluster: Cluster) -> None:
    cluster.admin.create(waiting_job("gives-up", runPolicy={"schedulingTimeoutSeconds": 5}))
    failed = wait_for(lambda: (x := condition(cluster, "gives-up", "Failed")).get("status") == "True" and x,
                      timeout=90, what="the job failed for its scheduling timeout")
    assert failed["reason"] == "SchedulingTimeoutExceeded"
    assert "past spec.runPolicy.schedulingTimeoutSeconds=5" in failed["message"]
    assert "didn't match" in failed["message"]  # the scheduler's own words (node selector)
    assert status(cluster, "gives-up")["phase"] == "Failed"
    wait_for(lambda: events(cluster, "gives-up", "SchedulingTimeoutExceeded"), timeout=30, what="the Failed Event")
    cluster.kubectl("delete", "ddj", "-n", JOBS, "gives-up")


def test_a_bad_image_with_backoff_limit_6_and_2_replicas_ends_failed(cluster: Cluster) -> None:
    job = tiny_job("bad-image", replicas=2)  # backoffLimit: the default 6
    job["spec"]["learnerGroups"][0]["image"] = "registry.invalid/no-such-learner:0"
    cluster.kubelet.pullable = lambda image: "no-such" not in image
    try:
        cluster.admin.create(job)
        failed = wait_for(lambda: (x := condition(cluster, "bad-image", "Failed")).get("status") == "True" and x,
                          timeout=90, what="the job failed for its image")
    finally:
        cluster.kubelet.pullable = lambda image: True
    assert failed["reason"] == "ImagePullFailed" and "every pod of the learner group local (2)" in failed["message"]
    assert "registry.invalid/no-such-learner:0" in failed["message"] and "ErrImagePull" in failed["message"]
    final = status(cluster, "bad-image")
    assert final["phase"] == "Failed" and final["failures"]["permanent"] == 2  # counted once each: 2 <= 6
    wait_for(lambda: [e for e in events(cluster, "bad-image", "ImagePullFailed") if "every pod" in e["message"]],
             timeout=30, what="the ImagePullFailed ending's Event")
    cluster.kubectl("delete", "ddj", "-n", JOBS, "bad-image")
