"""A queued job's life under Kueue on the real control plane, Kueue played from its source.

tests/realapi/kueue.py plays Kueue's scheduler and workload controller (admission, partial
admission, workload slices, preemption, deactivation, the waitForPodsReady timeout) and nothing
else: every step Kueue leaves to a job integration (stopping the job, giving the quota back once
its pods are gone, PodsReady, growing by a slice) is the operator's, running as the chart's
ServiceAccount. Each test stands alone: its own jobs, its own Kueue, its own quota.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import priorities
from diloco.operator.render import naming as n
from diloco.operator.status.conditions import find
from tests.helpers import wait_for
from tests.realapi.cluster import DEFAULT_FLAVOR, JOBS, Cluster, real_cluster
from tests.realapi.kueue import Kueue
from tests.realapi.test_operator import tiny_job

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(600)]
QUEUE, CLUSTER_QUEUE = "training", "cluster-queue"
PRIORITIES = {"low": 10, "high": 1000}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with real_cluster(tmp_path_factory.mktemp("realapi-kueue-life"), kueue=True) as c:
        for name, value in PRIORITIES.items():
            c.admin.create({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "WorkloadPriorityClass",
                            "metadata": {"name": name}, "value": value})
        yield c


def queued_job(name: str, replicas: int = 1, priority: str | None = None, **group: Any) -> dict[str, Any]:
    job = tiny_job(name, replicas=replicas)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: QUEUE, **({priorities.PRIORITY_LABEL: priority} if priority else {})}
    job["spec"]["learnerGroups"][0].update(group)
    return job


def workloads(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return cluster.admin.list("Workload", JOBS, n.selector(name))


def held(cluster: Cluster, name: str) -> dict[str, Any] | None:
    return next((w for w in workloads(cluster, name) if kueue.holds_quota(w) and not kueue.finished(w)), None)


def pods(cluster: Cluster, name: str, component: str | None = None) -> list[dict[str, Any]]:
    return [p for p in cluster.admin.list("Pod", JOBS, n.selector(name))
            if component is None or p["metadata"]["labels"].get(n.COMPONENT) == component]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def status(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.job(name).get("status") or {}


def admitted_condition(cluster: Cluster, name: str) -> dict[str, Any]:
    return find(status(cluster, name).get("conditions") or [], kueue.JOB_ADMITTED) or {}


def wl_condition(wl: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return find(((wl or {}).get("status") or {}).get("conditions") or [], type_) or {}


def events_for(cluster: Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.events(JOBS, reason) if e["involvedObject"]["name"] == name]


def delete(cluster: Cluster, *names: str) -> None:
    cluster.kubectl("delete", "ddj", "-n", JOBS, *names, "--wait=false")
    for name in names:
        wait_for(lambda name=name: not pods(cluster, name), timeout=90, what=f"{name}'s pods gone")


def test_a_preempted_job_gives_its_quota_back_and_resumes_from_its_checkpoint(cluster: Cluster) -> None:
    sim = Kueue(cluster.admin, JOBS, quota=2, cluster_queue=CLUSTER_QUEUE, flavor=DEFAULT_FLAVOR)
    with sim.running():
        cluster.admin.create(queued_job("low", priority="low"))
        before = wait_for(lambda: (s := status(cluster, "low")).get("learners") == "1/1"
                          and s.get("outerVersion", 0) >= 3 and s, timeout=180, what="the low job training")
        cluster.admin.create(queued_job("high", priority="high"))
        wait_for(lambda: kueue.evicted(held(cluster, "low")), timeout=30, what="Kueue preempting the low job")
        wait_for(lambda: not pods(cluster, "low"), timeout=90, what="the preempted job's pods gone")
        gone = time.monotonic()
        wait_for(lambda: held(cluster, "low") is None, timeout=30, what="its quota given back")
        released = time.monotonic() - gone
        (wl,) = workloads(cluster, "low")
        assert wl_condition(wl, "Requeued")["status"] == "True" and wl_condition(wl, "Requeued")["reason"] == \
            "Preempted"
        assert (wl_condition(wl, "QuotaReserved")["status"], wl_condition(wl, "QuotaReserved")["reason"]) == \
            ("False", "PendingEvaluation")
        assert not (wl.get("status") or {}).get("admission")
        # Fix 1: PodsReady as Kueue writes it for a Workload no longer admitted (generatePodsReadyCondition).
        assert (wl_condition(wl, "PodsReady")["status"], wl_condition(wl, "PodsReady")["reason"]) == \
            ("False", "WaitForStart")
        wait_for(lambda: admitted_condition(cluster, "low").get("reason") == "Requeued", timeout=30,
                 what="the low job's Admitted condition saying Requeued")
        assert events_for(cluster, "low", "QuotaReleased")
        wait_for(lambda: len([p for p in pods(cluster, "high") if ready(p)]) == 2, timeout=120,
                 what="the preemptor admitted and running")
        delete(cluster, "high")  # its quota returns: the low job is admitted again
        after = wait_for(lambda: (s := status(cluster, "low")).get("learners") == "1/1"
                         and s.get("outerVersion", 0) > before["outerVersion"] and s, timeout=180,
                         what="the low job resumed")
        assert after["tokensMerged"] >= before["tokensMerged"]
        again = wait_for(lambda: wl_condition(held(cluster, "low"), "PodsReady").get("status") == "True"
                         and held(cluster, "low"), timeout=60, what="PodsReady True on the re-admitted job")
        assert wl_condition(again, "PodsReady")["reason"] == "Started"  # from WaitForStart, not WaitForRecovery
    print(f"quota released {released:.1f} s after the last pod went; Kueue: {sim.log}")
    assert released < 15, f"the quota came back {released:.1f} s after the pods went"
    delete(cluster, "low")


def test_with_wait_for_pods_ready_a_started_job_stays_and_a_stuck_one_is_evicted_and_requeued(
        cluster: Cluster) -> None:
    sim = Kueue(cluster.admin, JOBS, quota=4, cluster_queue=CLUSTER_QUEUE, flavor=DEFAULT_FLAVOR,
                pods_ready_timeout=30, backoff_base=5)
    with sim.running():
        cluster.admin.create(queued_job("steady"))
        cluster.admin.create(queued_job("stuck", nodeSelector={"diloco.dev/no-such-node": "true"}))
        got = wait_for(lambda: wl_condition(held(cluster, "steady"), "PodsReady").get("status") == "True"
                       and held(cluster, "steady"), timeout=150, what="PodsReady on the steady job's Workload")
        assert wl_condition(got, "PodsReady")["reason"] == "Started"
        wait_for(lambda: ("evicted:PodsReadyTimeout:WaitForStart", workloads(cluster, "stuck")[0]["metadata"]["name"])
                 in sim.log,
                 timeout=120, what="the stuck job evicted for its PodsReady timeout")
        wait_for(lambda: held(cluster, "stuck") is None and not pods(cluster, "stuck"), timeout=60,
                 what="the stuck job stopped and its quota given back")
        (wl,) = workloads(cluster, "stuck")
        assert (wl_condition(wl, "Requeued")["status"], wl_condition(wl, "Requeued")["reason"]) == \
            ("False", "PodsReadyTimeout")
        assert wl_condition(wl, "PodsReady")["reason"] == "WaitForStart"
        assert wl["status"]["requeueState"]["count"] == 1  # Kueue's requeue backoff, 5 s for the first
        assert events_for(cluster, "stuck", "QuotaReleased")
        wait_for(lambda: ("backoff-finished", wl["metadata"]["name"]) in sim.log, timeout=30,
                 what="the stuck job's backoff over")
        requeued = wait_for(lambda: kueue.holds_quota(w := workloads(cluster, "stuck")[0]) and w, timeout=30,
                            what="the stuck job admitted again after its backoff")
        assert (wl_condition(requeued, "Requeued")["status"], wl_condition(requeued, "Requeued")["reason"]) == \
            ("True", "BackoffFinished")
        steady = held(cluster, "steady")
        assert steady is not None and not kueue.evicted(steady), "the started job was evicted"
        since = datetime.strptime(wl_condition(steady, "Admitted")["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ")
        assert datetime.now(UTC) - since.replace(tzinfo=UTC) > timedelta(seconds=30)  # past the timeout, kept
    delete(cluster, "steady", "stuck")


def test_an_elastic_job_runs_what_it_was_given_then_grows_without_restarting_and_shrinks(cluster: Cluster) -> None:
    sim = Kueue(cluster.admin, JOBS, quota=4, cluster_queue=CLUSTER_QUEUE, flavor=DEFAULT_FLAVOR)  # 3 learners
    with sim.running():
        cluster.admin.create(queued_job("elastic", replicas=8, minReplicas=2))
        first = wait_for(lambda: len(ps := [p for p in pods(cluster, "elastic", n.LEARNER) if ready(p)]) == 3 and ps,
                         timeout=180, what="three learners of eight running")
        cond = admitted_condition(cluster, "elastic")
        assert cond["status"] == "True" and "local 3 of 8" in cond["message"], cond
        grow = wait_for(lambda: [w for w in workloads(cluster, "elastic") if not kueue.holds_quota(w)],
                        timeout=30, what="a slice queued for the other five")
        assert grow[0]["spec"]["podSets"][0]["count"] == 8
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in first}
        version = wait_for(lambda: status(cluster, "elastic").get("outerVersion", 0) >= 2 and
                           status(cluster, "elastic")["outerVersion"], timeout=120, what="the three training")
        time.sleep(3)
        assert len(pods(cluster, "elastic", n.LEARNER)) == 3  # nothing more runs while the quota is short
        sim.quota = 9  # quota frees: room for all eight and the syncer
        wait_for(lambda: len([p for p in pods(cluster, "elastic", n.LEARNER) if ready(p)]) == 8, timeout=240,
                 what="all eight learners running")
        now = {p["metadata"]["name"]: p for p in pods(cluster, "elastic", n.LEARNER)}
        assert {name: now[name]["metadata"]["uid"] for name in uids} == uids, "a running learner was replaced"
        for name in uids:
            assert all(c.get("restartCount", 0) == 0 for c in now[name]["status"]["containerStatuses"]), name
        assert [(w["metadata"]["name"], w["spec"]["podSets"][0]["count"]) for w in workloads(cluster, "elastic")
                if kueue.holds_quota(w) and not kueue.finished(w)] == [(grow[0]["metadata"]["name"], 8)]
        wait_for(lambda: status(cluster, "elastic").get("outerVersion", 0) > version, timeout=120,
                 what="training continuing on eight")
        cluster.admin.patch("DecoupledDiLoCoJob", JOBS, "elastic", {"spec": {"learnerGroups": [
            {"name": "local", "replicas": 4, "minReplicas": 2}]}})
        wait_for(lambda: len(pods(cluster, "elastic", n.LEARNER)) == 4, timeout=120, what="shrunk to four")
        shrunk = held(cluster, "elastic")
        assert shrunk is not None and shrunk["metadata"]["name"] == grow[0]["metadata"]["name"]  # in place
        assert shrunk["spec"]["podSets"][0]["count"] == 4
        kept = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, "elastic", n.LEARNER)}
        assert kept == {name: p["metadata"]["uid"] for name, p in now.items() if int(name.rsplit("-", 1)[1]) < 4}
    print(f"Kueue: {sim.log}")
    delete(cluster, "elastic")
