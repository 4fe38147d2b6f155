"""A standby syncer's takeover on the real control plane (issue 62; tests/realapi/cluster.py).

A job with spec.syncer.checkpoints in an S3 bucket (moto's server, tests/s3_server.py; its
credentials in a Secret the syncer reads through envFrom) and spec.syncer.standby, trained on a
real Kubernetes 1.20 control plane with the operator logged in as the chart's ServiceAccount.
Two test-side kubelets (tests/realapi/kubelet.py), one Node in each of two zones, share one
process runtime: the real scheduler places the syncer's two pods one per zone (the required
zone anti-affinity the operator renders), and both run. The active syncer's process is
SIGKILLed, as a node loss would end it (the kubelet restarts it later, and it comes back as the
standby); the standby takes the lease in the bucket and serves, the operator's status names it
(status.syncer.active, leaseEpoch, takeovers), a SyncerTakeover Event goes on the job, and the
outer version keeps rising. The times from the kill to each are printed.

What the process runtime (tests/kube/processes.py) does here that one pod per Service never
needed: learners and the operator dial the syncer's Service; both syncer pods are behind it,
and only the lease holder opens its gRPC port (its readiness port), so the two share that
Service port and whichever holds the lease is the one listening: the Service follows the active
pod as kube-proxy would. Their metrics ports (both open at once) are each pod's own. A pod's
host name is its name (the syncer names its lease holder by it), and envFrom is read.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from diloco.checkpoint_objects import open_store
from diloco.operator.render import naming as n
from tests.helpers import wait_for
from tests.realapi.cluster import JOBS, Cluster, real_cluster
from tests.realapi.kubelet import NODE, Kubelet
from tests.realapi.test_operator import events, refused, status, tiny_job
from tests.s3_server import Bucket, s3_bucket

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
NAME, SECRET = "standby", "standby-store"
ZONE = "topology.kubernetes.io/zone"
ZONES = {NODE: "zone-a", "diloco-node-1": "zone-b"}
LEASE_SECONDS = 4.0


@pytest.fixture(scope="module")
def zonal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Bucket]]:
    """The lane's cluster, its kubelet's Node in zone a and a second kubelet's in zone b, and a bucket."""
    with s3_bucket(NAME) as bucket, real_cluster(tmp_path_factory.mktemp("realapi-takeover")) as c:
        c.admin.request("PATCH", f"api/v1/nodes/{NODE}", {"metadata": {"labels": {ZONE: ZONES[NODE]}}},
                        content_type="application/merge-patch+json")
        (second,) = set(ZONES) - {NODE}
        with Kubelet(c.admin, c.runtime, volumes=c.kubelet.volumes, namespaces=c.kubelet.namespaces,
                     node=second, labels={ZONE: ZONES[second]}):
            yield c, bucket
        assert not refused(c), f"the chart's RBAC refused the operator: {refused(c)}"


def syncer_pods(c: Cluster) -> list[dict[str, Any]]:
    return c.admin.list("Pod", JOBS, n.selector(NAME, n.SYNCER))


def took_over(c: Cluster) -> list[dict[str, Any]]:
    return events(c, NAME, "SyncerTakeover")


def test_the_standby_takes_over_and_the_job_says_so(zonal: tuple[Cluster, Bucket]) -> None:
    c, bucket = zonal
    c.admin.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": JOBS},
                    "stringData": bucket.env})
    c.admin.create(tiny_job(NAME, syncer={
        "fragments": 2, "checkpointIntervalSeconds": 1,
        "checkpoints": {"url": bucket.url, "secretName": SECRET}, "standby": {"leaseSeconds": LEASE_SECONDS}}))

    # Both syncer pods run, one in each zone (the real scheduler, the operator's anti-affinity).
    def running() -> list[dict[str, Any]]:
        ps = syncer_pods(c)
        return ps if len(ps) == 2 and all((p.get("status") or {}).get("phase") == "Running" for p in ps) else []

    pods = wait_for(running, 120, 0.5, "both syncer pods running")
    assert sorted(ZONES[p["spec"]["nodeName"]] for p in pods) == ["zone-a", "zone-b"], \
        [p["spec"]["nodeName"] for p in pods]
    names = {p["metadata"]["name"] for p in pods}

    # Learners train, and the status names the active syncer: one of the two pods.
    def training() -> dict[str, Any]:
        s = status(c, NAME)
        return s if s.get("phase") == "Running" and s.get("learners") == "2/2" and \
            (s.get("syncer") or {}).get("active") in names and (s.get("outerVersion") or 0) >= 8 else {}

    s = wait_for(training, 180, 0.5, "learners training through the active syncer, named in the status")
    active = s["syncer"]["active"]
    (standby,) = names - {active}
    epoch, takeovers = s["syncer"]["leaseEpoch"], s["syncer"].get("takeovers") or 0
    assert not took_over(c), "a takeover before any fault"
    assert open_store(bucket.url).newest() is not None, "no checkpoint in the bucket"  # through the Secret's keys
    wait_for(lambda: "standby:" in (c.runtime.logs_of(standby) or [""])[-1], 60, 0.5, f"{standby} to stand by")

    # The active syncer's process dies as with its node: SIGKILL, no final checkpoint, no handover.
    victim = next(p for p in pods if p["metadata"]["name"] == active)
    t_kill = time.monotonic()
    c.runtime.kill(victim, signal.SIGKILL)
    seen: dict[str, float] = {}

    def both() -> bool:
        now, syncer = time.monotonic(), status(c, NAME).get("syncer") or {}
        if "status" not in seen and syncer.get("active") == standby:
            seen["status"] = now
        if "event" not in seen and took_over(c):
            seen["event"] = now
        return len(seen) == 2

    wait_for(both, 60, 0.1, f"the status to name {standby} and a SyncerTakeover Event")
    after = status(c, NAME)
    assert after["syncer"]["active"] == standby
    assert after["syncer"]["leaseEpoch"] > epoch and after["syncer"]["takeovers"] == takeovers + 1, after["syncer"]
    (event,) = took_over(c)
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "DecoupledDiLoCoJob", event
    assert event["message"].startswith(f"syncer {standby} took over the lease (epoch {after['syncer']['leaseEpoch']}) "
                                       f"from {active}"), event["message"]

    # Training goes on through the new active syncer: the outer version keeps rising.
    version = int(after.get("outerVersion") or 0)
    wait_for(lambda: int(status(c, NAME).get("outerVersion") or 0) >= version + 8, 60, 0.5,
             "the outer version to rise under the new active syncer")
    # The killed pod is restarted by the kubelet and stands by; the lease stays where it went.
    wait_for(lambda: any(p["metadata"]["name"] == active and p["status"]["containerStatuses"][0]["restartCount"]
                         for p in syncer_pods(c)) and "standby:" in c.runtime.logs_of(active)[-1], 60, 0.5,
             f"{active} restarted, back as the standby")
    assert status(c, NAME)["syncer"]["active"] == standby
    print(f"\nstandby takeover on the real control plane: kill -> status names {standby}: "
          f"{seen['status'] - t_kill:.1f} s; kill -> SyncerTakeover Event: {seen['event'] - t_kill:.1f} s "
          f"(lease {LEASE_SECONDS:.0f} s, status every 1 s)")
