"""Drift: a hand edit of a child is seen (and put back by children.plan), what the API server
adds or normalises is not."""

from __future__ import annotations

import copy
from typing import Any

from diloco.operator.reconcile import drift
from diloco.operator.reconcile.children import plan, stamped
from diloco.operator.render import naming as n


def statefulset() -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "demo-us", "namespace": "research", "labels": {n.JOB: "demo"},
                         "ownerReferences": [{"uid": "uid-1"}]},
            "spec": {"replicas": 2, "template": {"spec": {
                "automountServiceAccountToken": False, "hostNetwork": False,
                "containers": [{"name": "learner", "image": "learner:1", "args": [], "env": [],
                                "resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}},
                                "ports": [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]}]}}}}


def as_served(obj: dict[str, Any]) -> dict[str, Any]:
    """What a real server returns: defaults added, empty values dropped, quantities canonical."""
    live = copy.deepcopy(obj)
    live["apiVersion"] = "apps/v1"
    live["metadata"].update(uid="s-1", resourceVersion="7", ownerReferences=[{"uid": "uid-1"}, {"uid": "other"}])
    pod = live["spec"]["template"]["spec"]
    pod.update(restartPolicy="Always", dnsPolicy="ClusterFirst")
    del pod["hostNetwork"]
    (c,) = pod["containers"]
    del c["args"], c["env"]
    c.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    c["resources"]["requests"] = {"cpu": "500m", "memory": "1Gi"}
    live["status"] = {"replicas": 2}
    return live


def test_what_the_server_adds_or_normalises_is_not_drift() -> None:
    desired = stamped(statefulset())
    assert not drift.drifted(as_served(desired), desired)
    assert plan([statefulset()], [as_served(desired)], "uid-1").apply == []


def test_a_hand_edit_of_a_field_we_set_is_drift_and_is_put_back() -> None:
    desired = stamped(statefulset())
    for edit in (lambda o: o["spec"].update(replicas=5),
                 lambda o: o["spec"]["template"]["spec"]["containers"][0].update(image="evil:1"),
                 lambda o: o["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"].update(cpu="2"),
                 lambda o: o["metadata"]["labels"].pop(n.JOB),
                 lambda o: o["spec"]["template"]["spec"]["containers"][0]["ports"].clear()):
        live = as_served(desired)
        edit(live)
        assert drift.drifted(live, desired)
        assert [o["metadata"]["name"] for o in plan([statefulset()], [live], "uid-1").apply] == ["demo-us"]


def test_fields_added_by_hand_that_we_never_set_are_left_alone() -> None:
    desired = stamped(statefulset())
    live = as_served(desired)
    live["metadata"]["labels"]["team"] = "research"
    live["spec"]["template"]["spec"]["priorityClassName"] = "high"
    assert not drift.drifted(live, desired)


def test_quantities_compare_by_value() -> None:
    assert drift.quantity("500m") == drift.quantity("0.5") and drift.quantity("1Gi") == drift.quantity("1024Mi")
    assert drift.quantity("2") == drift.quantity(2) and drift.quantity("us-0") is None
    assert not drift.contains("us-0", "us-1")
