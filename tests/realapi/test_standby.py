"""The standby syncer's placement on the real control plane (tests/realapi/): the Deployment the
operator renders for spec.syncer.standby (operator/render/job.py), created on a real Kubernetes
1.20 API server, and its two pods placed by the real kube-scheduler on nodes of three zones.

No operator and no kubelet here: three Node objects (two in zone a, one in zone b) with a Ready
status stand in for a regional cluster, which is all the scheduler reads. Required zone
anti-affinity puts the second pod in the other zone, never beside the first, and a third pod
of the same rule (one more zone than there are) stays Pending with the scheduler's reason.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.operator.kube import Kube
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from tests.helpers import wait_for
from tests.realapi.controlplane import ControlPlane
from tests.realapi.test_operator import tiny_job

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(120)]
NS = "standby"
NODES = {"node-a-0": "zone-a", "node-a-1": "zone-a", "node-b-0": "zone-b"}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    with ControlPlane(Path(tmp_path_factory.mktemp("realapi-standby")) / "control-plane") as plane:
        kube = Kube(plane.url, token=plane.admin_token, ca_file=str(plane.ca_file), user_agent="diloco-tests")
        kube.request("POST", "api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        t = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for name, zone in NODES.items():
            kube.request("POST", "api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                         "topology.kubernetes.io/zone": zone}}})
            capacity = {"cpu": "16", "memory": "64Gi", "pods": "110"}
            kube.request("PATCH", f"api/v1/nodes/{name}/status", {"status": {
                "capacity": capacity, "allocatable": capacity,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "stand-in",
                                "lastHeartbeatTime": t, "lastTransitionTime": t}]}},
                content_type="application/merge-patch+json")
        yield kube


def pods(kube: Kube, job: str) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in n.selector(job, n.SYNCER).items())
    got = kube.request("GET", f"api/v1/namespaces/{NS}/pods", params={"labelSelector": selector})
    return list(got["items"])


def test_the_standby_is_scheduled_in_another_zone(api: Kube) -> None:
    manifest = tiny_job("zonal", syncer={"fragments": 2, "checkpoints": {"url": "s3://bucket/zonal"},
                                         "standby": {"leaseSeconds": 6}})
    from diloco.spec import parse_job

    job = parse_job({**manifest, "metadata": {"name": "zonal", "namespace": NS}})
    deployment = render.syncer_deployment(job, render.Owner("zonal", NS, "uid-zonal"))
    deployment["metadata"].pop("ownerReferences")  # no job object here: the garbage collector would take it
    created = api.request("POST", f"apis/apps/v1/namespaces/{NS}/deployments", deployment)
    # The server kept what the standby rests on: two replicas, the anti-affinity, the probes.
    spec = created["spec"]["template"]["spec"]
    assert created["spec"]["replicas"] == 2
    term = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "topology.kubernetes.io/zone"
    assert spec["containers"][0]["readinessProbe"]["tcpSocket"]["port"] == "grpc"
    assert spec["containers"][0]["livenessProbe"]["tcpSocket"]["port"] == "metrics"

    bound = wait_for(lambda: (ps := pods(api, "zonal")) and len(ps) == 2
                     and all(p["spec"].get("nodeName") for p in ps) and ps, 60, what="both syncer pods scheduled")
    zones = sorted(NODES[p["spec"]["nodeName"]] for p in bound)
    assert zones == ["zone-a", "zone-b"], [p["spec"]["nodeName"] for p in bound]

    # A third replica of the same rule has no zone left: Pending, the scheduler says why.
    api.request("PATCH", f"apis/apps/v1/namespaces/{NS}/deployments/{n.syncer('zonal')}", {"spec": {"replicas": 3}},
                content_type="application/merge-patch+json")

    def unschedulable() -> str | None:
        for p in pods(api, "zonal"):
            for cond in (p.get("status") or {}).get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    return str(cond.get("message"))
        return None

    message = wait_for(unschedulable, 60, what="the third syncer pod to be refused a node")
    assert "anti-affinity" in message, message
