"""Topology-aware admission's scheduling gate, against the emulated API server (kmock): the pods
of a TAS-assigned PodSet are found and ungated by Kueue's TopologyUngater as its source does it
(tests/kube/topology_ungater.py), and a pod nobody ungates shows on the job by the gate's name
(capacity.py)."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator.context import Config
from diloco.operator.failures import capacity
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import topology
from diloco.operator.render import naming as n
from diloco.operator.status.conditions import PODS_UNSCHEDULABLE, find
from tests.helpers import wait_for
from tests.kube import NAMESPACE
from tests.kube.controllers import is_ready
from tests.kube.running import OperatorThread
from tests.kube.topology_ungater import ungate
from tests.operator.kueue.test_integration import serve_kueue

pytest_plugins = ["tests.kube.fixtures"]
BLOCK, HOST = "cloud.google.com/gce-topology-block", "kubernetes.io/hostname"


def manifest(name: str) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {kueue.QUEUE_LABEL: "training"},
                         "annotations": {topology.REQUIRED: BLOCK}},
            "spec": {"learnerGroups": [{"name": "gpu", "replicas": 2}], "syncer": {"fragments": 2}}}


def admit_with_topology(api: Any, wl: dict[str, Any]) -> None:
    """Kueue's scheduler with TAS: the learners' PodSet placed one pod per host of block b1."""
    conds = [{"type": t, "status": "True", "reason": t, "message": t, "lastTransitionTime": "2026-01-01T00:00:00Z"}
             for t in ("QuotaReserved", "Admitted")]
    api.patch("Workload", NAMESPACE, wl["metadata"]["name"], {"status": {"conditions": conds, "admission": {
        "clusterQueue": "cluster-queue", "podSetAssignments": [
            {"name": "gpu", "count": 2, "flavors": {"cpu": "tas"},
             "topologyAssignment": {"levels": [BLOCK, HOST],
                                    "domains": [{"values": ["b1", "n1"], "count": 1},
                                                {"values": ["b1", "n2"], "count": 1}]}},
            {"name": "syncer", "count": 1, "flavors": {"cpu": "tas"}}]}}}, sub="status")


def learners(api: Any, name: str) -> list[dict[str, Any]]:
    return sorted(api.list("Pod", NAMESPACE, n.selector(name, n.LEARNER)), key=lambda p: p["metadata"]["name"])


@pytest.mark.slow
def test_the_topology_ungater_finds_the_pods_and_places_them_and_a_pod_left_gated_is_named(
        cluster: Any, api: Any, controllers: Any) -> None:
    serve_kueue(cluster, "v1beta1")
    api.create({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor", "metadata": {"name": "tas"},
                "spec": {"topologyName": "default"}})
    config = Config(status_interval=0.5, chaos_interval=0.25, stuck_timeout=1.0, kueue=True, gate_grace=2.0)
    with OperatorThread(config):
        names = {}
        for name in ("placed", "forgotten"):
            api.create(manifest(name))
            (wl,) = wait_for(lambda name=name: api.list("Workload", NAMESPACE, n.selector(name)), what="a Workload")
            assert wl["spec"]["podSets"][0]["topologyRequest"]["required"] == BLOCK
            admit_with_topology(api, wl)
            names[name] = wl["metadata"]["name"]
        gated = wait_for(lambda: len(p := learners(api, "placed")) == 2 and p, timeout=60, what="the admitted job's learners")
        for pod in gated:  # what Kueue's integration puts on them, and the scheduler leaves them be
            assert pod["spec"]["schedulingGates"] == [{"name": kueue.TOPOLOGY_GATE}]
            assert pod["metadata"]["annotations"][kueue.WORKLOAD_ANNOTATION] == names["placed"]
            assert pod["metadata"]["labels"][kueue.POD_SET_LABEL] == "gpu"
        wait_for(lambda: all(find(p.get("status", {}).get("conditions") or [], "PodScheduled") for p in
                             learners(api, "placed")), timeout=30, what="the scheduler marking them gated")
        assert not any(is_ready(p) for p in learners(api, "placed"))
        (placed_wl,) = api.list("Workload", NAMESPACE, n.selector("placed"))
        assert sorted(ungate(api, placed_wl)) == [p["metadata"]["name"] for p in gated]

        def running() -> list[dict[str, Any]] | None:
            pods = learners(api, "placed")
            return pods if len(pods) == 2 and all(is_ready(p) for p in pods) else None

        ready = wait_for(running, timeout=30, what="the ungated learners running")
        assert [p["spec"]["nodeSelector"] for p in ready] == [{BLOCK: "b1", HOST: "n1"}, {BLOCK: "b1", HOST: "n2"}]
        assert all("schedulingGates" not in p["spec"] for p in ready)
        # The other job's pods are never ungated: past the grace, the job says which gate holds them.

        def named() -> dict[str, Any] | None:
            conds = (api.get("DecoupledDiLoCoJob", NAMESPACE, "forgotten").get("status") or {}).get("conditions")
            cond = find(conds or [], PODS_UNSCHEDULABLE)
            return cond if cond and cond["status"] == "True" else None

        cond = wait_for(named, timeout=30, what="PodsUnschedulable on the job whose pods stay gated")
        assert "gated since" in cond["message"] and f"scheduling gate {kueue.TOPOLOGY_GATE}" in cond["message"]
        assert "TopologyUngater" in cond["message"]
        placed_conds = api.get("DecoupledDiLoCoJob", NAMESPACE, "placed")["status"]["conditions"]
        assert (find(placed_conds, PODS_UNSCHEDULABLE) or {}).get("status") != "True"
        events = api.request("GET", f"api/v1/namespaces/{NAMESPACE}/events").get("items") or []
        assert any(e["reason"] == capacity.WAITING and e["involvedObject"]["name"] == "forgotten" and
                   kueue.TOPOLOGY_GATE in e["message"] for e in events)
