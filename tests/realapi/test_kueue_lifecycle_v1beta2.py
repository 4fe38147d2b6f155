"""The integration's side of a Workload's life on a Kueue that serves v1beta2 only (real control
plane, Kueue played from its source by tests/realapi/kueue.py): a job deactivated by its
Workload's `spec.active: false` stops, gives its quota back and stays out of the queue; set active
again, it is admitted and resumes from the syncer's checkpoint. PodsReady is written in v1beta2
as in v1beta1 (tests/realapi/test_kueue_lifecycle.py has the rest, on v1beta1)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from diloco.operator.kueue import integration as kueue
from tests.helpers import wait_for
from tests.realapi.cluster import DEFAULT_FLAVOR, JOBS, Cluster, real_cluster
from tests.realapi.kueue import Kueue
from tests.realapi.test_kueue_lifecycle import (
    CLUSTER_QUEUE,
    admitted_condition,
    delete,
    events_for,
    held,
    pods,
    queued_job,
    status,
    wl_condition,
    workloads,
)

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with real_cluster(tmp_path_factory.mktemp("realapi-kueue-life-v1beta2"), kueue="v1beta2") as c:
        yield c


def test_a_deactivated_job_gives_its_quota_back_and_resumes_when_active_again(cluster: Cluster) -> None:
    sim = Kueue(cluster.admin, JOBS, quota=2, cluster_queue=CLUSTER_QUEUE, flavor=DEFAULT_FLAVOR)
    with sim.running():
        cluster.admin.create(queued_job("paused"))
        ready = wait_for(lambda: wl_condition(held(cluster, "paused"), "PodsReady").get("status") == "True"
                         and held(cluster, "paused"), timeout=180, what="PodsReady on the v1beta2 Workload")
        assert ready["apiVersion"] == "kueue.x-k8s.io/v1beta2"
        before = wait_for(lambda: (s := status(cluster, "paused")).get("outerVersion", 0) >= 2 and s, timeout=120,
                          what="the job training")
        name = ready["metadata"]["name"]
        cluster.admin.patch("Workload", JOBS, name, {"spec": {"active": False}})  # Kueue's way to pause a job
        wait_for(lambda: held(cluster, "paused") is None and not pods(cluster, "paused"), timeout=90,
                 what="the deactivated job stopped and its quota given back")
        (wl,) = workloads(cluster, "paused")
        assert (wl_condition(wl, "Requeued")["status"], wl_condition(wl, "Requeued")["reason"]) == \
            ("False", "Deactivated")
        wait_for(lambda: admitted_condition(cluster, "paused").get("reason") == "Deactivated", timeout=30,
                 what="the job's Admitted condition saying Deactivated")
        assert "spec.active" in admitted_condition(cluster, "paused")["message"]
        assert events_for(cluster, "paused", "QuotaReleased")
        time.sleep(3)
        assert held(cluster, "paused") is None  # out of the queue while inactive
        cluster.admin.patch("Workload", JOBS, name, {"spec": {"active": True}})
        after = wait_for(lambda: (s := status(cluster, "paused")).get("learners") == "1/1"
                         and s.get("outerVersion", 0) > before["outerVersion"] and s, timeout=180,
                         what="the job admitted again and resumed")
        assert after["tokensMerged"] >= before["tokensMerged"] and kueue.admitted(held(cluster, "paused"))
    delete(cluster, "paused")
