"""What guards a job, without a cluster: who may reach its syncer, the token as a file, no API
credentials in its pods, a drain that waits for the syncer, a checkpoint that outlives the job,
which pods a finished job keeps, and a suspended job that holds no pods."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator.reconcile.children import MANAGED_KINDS, plan
from diloco.operator.render import access, policies
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from tests.operator.render.test_job import EXPOSED, OWNER, TOKEN, by_key, job, kinds, remote_job

STATE = {("ConfigMap", "demo-config"), ("Secret", "demo-token"), ("PersistentVolumeClaim", "demo-checkpoints"),
         ("NetworkPolicy", "demo-syncer")}
SYNCER = {("Deployment", "demo-syncer"), ("Service", "demo-syncer")}
LEARNERS = {("StatefulSet", "demo-us"), ("Service", "demo-us"), ("StatefulSet", "demo-eu"), ("Service", "demo-eu")}
PDB = ("PodDisruptionBudget", "demo-syncer")


def running(**spec: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return by_key(render.children(job(**spec), OWNER, TOKEN, started=True, finished=False))


def pod_specs(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {k: o["spec"]["template"]["spec"] for k, o in objs.items() if k[0] in ("StatefulSet", "Deployment")}


def test_the_network_policy_admits_learners_and_the_operator_to_grpc_and_scrapers_to_metrics() -> None:
    peers = policies.Peers(operator_namespace="diloco-system",
                           operator_labels={"app.kubernetes.io/name": "decoupled-diloco", "x": "y"},
                           metrics_from=({"namespaceSelector": {"matchLabels": {"team": "monitoring"}}},))
    objs = by_key(render.children(job(), OWNER, TOKEN, started=True, finished=False, peers=peers))
    policy = objs[("NetworkPolicy", "demo-syncer")]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": objs[("Service", "demo-syncer")]["spec"]["selector"]}
    assert spec["policyTypes"] == ["Ingress"]
    grpc, metrics = spec["ingress"]
    assert grpc["ports"] == [{"port": 50051, "protocol": "TCP"}]
    learners, operator = grpc["from"]
    assert learners == {"podSelector": {"matchLabels": {n.JOB: "demo", n.COMPONENT: "learner"}}}
    assert "namespaceSelector" not in learners  # this job's learners, in its own namespace only
    # Every learner pod template carries the labels the policy admits.
    for key, pod in objs.items():
        if key in {("StatefulSet", "demo-us"), ("StatefulSet", "demo-eu")}:
            assert learners["podSelector"]["matchLabels"].items() <= pod["spec"]["template"]["metadata"]["labels"].items()
    assert operator == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "diloco-system"}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "decoupled-diloco", "x": "y"}}}
    assert metrics == {"from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
                       "ports": [{"port": 9101, "protocol": "TCP"}]}
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # No scrapers named: no metrics rule at all (a rule without `from` would admit everyone).
    closed = by_key(render.children(job(), OWNER, TOKEN, started=True, finished=False,
                                    peers=policies.Peers(metrics_from=())))
    (only,) = closed[("NetworkPolicy", "demo-syncer")]["spec"]["ingress"]
    assert only["ports"] == [{"port": 50051, "protocol": "TCP"}] and only["from"]
    # The default: the operator by its labels in any namespace, metrics from any pod in the cluster.
    default = running()[("NetworkPolicy", "demo-syncer")]["spec"]["ingress"]
    assert default[0]["from"][1]["namespaceSelector"] == {} and default[1]["from"] == [{"namespaceSelector": {}}]


def test_an_exposed_syncer_admits_grpc_from_any_source_but_keeps_metrics_closed() -> None:
    exposed = job(**EXPOSED)
    objs = by_key(render.children(exposed, OWNER, TOKEN, started=True, finished=False,
                                  link=access.link(exposed, "research", {}), peers=policies.Peers(metrics_from=())))
    (grpc,) = objs[("NetworkPolicy", "demo-syncer")]["spec"]["ingress"]
    assert grpc == {"ports": [{"port": 50051, "protocol": "TCP"}]}  # the load balancer's clients; token and TLS


def test_a_learners_only_cluster_has_no_syncer_policy() -> None:
    link = access.link(remote_job(), "research", {"shared": {"data": {"token": "dA=="}}})
    objs = kinds(render.children(remote_job(), OWNER, TOKEN, started=True, finished=False, link=link))
    assert not {k for k in objs if k[0] in ("NetworkPolicy", "PodDisruptionBudget")}


def test_the_token_is_a_mounted_file_in_every_pod_and_no_variable_holds_it() -> None:
    for key, pod in pod_specs(running()).items():
        (c,) = pod["containers"]
        assert c["args"][c["args"].index("--token-file") + 1] == "/etc/diloco-token/token", key
        assert not [e for e in c["env"] if e["name"] == "DILOCO_TOKEN" or "secretKeyRef" in e.get("valueFrom", {})]
        assert {"name": "token", "mountPath": "/etc/diloco-token", "readOnly": True} in c["volumeMounts"]
        assert {"name": "token", "secret": {"secretName": "demo-token", "defaultMode": 0o440,
                                            "items": [{"key": "token", "path": "token"}]}} in pod["volumes"]
        assert TOKEN not in str(pod)
    # A learners-only cluster mounts the token key alone of the copied Secret (its CA goes to the TLS mount).
    link = access.link(remote_job(), "research", {"shared": {"data": {"token": "dA==", "ca.crt": "Y2E="}}})
    objs = by_key(render.children(remote_job(), OWNER, TOKEN, started=True, finished=False, link=link))
    pod = objs[("StatefulSet", "demo-eu")]["spec"]["template"]["spec"]
    token = next(v for v in pod["volumes"] if v["name"] == "token")
    assert token["secret"] == {"secretName": "shared", "defaultMode": 0o440, "items": [{"key": "token", "path": "token"}]}


def test_job_pods_get_no_service_account_token() -> None:
    specs = pod_specs(running(syncer={"fragments": 6, "shards": 3}))
    assert len(specs) == 3  # the syncer's StatefulSet and both groups
    assert all(pod["automountServiceAccountToken"] is False for pod in specs.values())


def test_the_syncer_has_a_disruption_budget_while_it_runs() -> None:
    for spec, workload in (({}, "Deployment"), ({"syncer": {"fragments": 6, "shards": 3}}, "StatefulSet")):
        objs = running(**spec)
        pdb = objs[PDB]
        assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 0
        assert pdb["spec"]["selector"] == objs[(workload, "demo-syncer")]["spec"]["selector"]
    for state in ({"finished": True}, {"finished": True, "outcome": "Failed"}, {"blocked": True}):
        assert PDB not in kinds(render.children(job(), OWNER, TOKEN, started=True, **{"finished": False, **state}))
    assert PDB not in kinds(render.children(job(suspend=True), OWNER, TOKEN, started=True, finished=False))


def test_the_checkpoint_outlives_the_job_unless_asked_otherwise() -> None:
    claim = running()[("PersistentVolumeClaim", "demo-checkpoints")]
    assert "ownerReferences" not in claim["metadata"] and claim["metadata"]["labels"][n.JOB] == "demo"
    deleted = running(runPolicy={"checkpointRetention": "Delete"})[("PersistentVolumeClaim", "demo-checkpoints")]
    assert deleted["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # A sharded syncer's volumes: made by the operator under the claim template's names, same rule.
    for retention, owned in (("Retain", False), ("Delete", True)):
        objs = running(syncer={"fragments": 6, "shards": 3}, runPolicy={"checkpointRetention": retention})
        claims = {k[1]: o for k, o in objs.items() if k[0] == "PersistentVolumeClaim"}
        (template,) = objs[("StatefulSet", "demo-syncer")]["spec"]["volumeClaimTemplates"]
        assert set(claims) == {f"{template['metadata']['name']}-demo-syncer-{i}" for i in range(3)}
        assert all(("ownerReferences" in c["metadata"]) is owned for c in claims.values())


def test_a_retained_claim_is_never_pruned_nor_reapplied() -> None:
    claim = running()[("PersistentVolumeClaim", "demo-checkpoints")]
    live = {**claim, "metadata": {**claim["metadata"], "uid": "c-1"}}
    done = plan([], [live], "uid-1")  # a job that no longer wants it (or a new one of the same name)
    assert done.delete == [] and done.apply == []
    owned = running(runPolicy={"checkpointRetention": "Delete"})[("PersistentVolumeClaim", "demo-checkpoints")]
    # Delete: the job owns it, so the garbage collector deletes it with the job; the operator never does.
    assert [r["uid"] for r in owned["metadata"]["ownerReferences"]] == [OWNER.uid]
    assert plan([], [owned], "uid-1").delete == []


@pytest.mark.parametrize("policy, outcome, kept", [
    ("Running", "Succeeded", set()),
    ("Running", "Failed", SYNCER),  # a failed job keeps its syncer for `kubectl logs`
    ("Running", None, set()),  # how it ended unknown: nothing kept
    ("All", "Succeeded", set()),
    ("All", "Failed", set()),
    ("None", "Succeeded", SYNCER | LEARNERS),
    ("None", "Failed", SYNCER | LEARNERS),
])
def test_clean_pod_policy_decides_which_pods_a_finished_job_keeps(policy: str, outcome: Any,
                                                                   kept: set[tuple[str, str]]) -> None:
    finished = job(runPolicy={"cleanPodPolicy": policy})
    objs = render.children(finished, OWNER, TOKEN, started=True, finished=True, outcome=outcome)
    assert kinds(objs) == STATE | kept
    assert job().spec.run_policy.clean_pod_policy == "Running"  # the default


def test_a_finished_exposed_job_is_no_longer_reachable_from_other_clusters() -> None:
    exposed = job(**EXPOSED, runPolicy={"cleanPodPolicy": "None"})
    objs = kinds(render.children(exposed, OWNER, TOKEN, started=True, finished=True, outcome="Failed"))
    assert ("Service", "demo-syncer-exposed") not in objs and ("Deployment", "demo-syncer") in objs


def test_the_outcome_comes_from_the_conditions() -> None:
    assert policies.outcome({}) is None
    assert policies.outcome({"conditions": [{"type": "Succeeded", "status": "True"}]}) == "Succeeded"
    failed = {"conditions": [{"type": "Failed", "status": "True"}], "completionTime": "2026-01-01T00:00:00Z"}
    assert policies.outcome(failed) == "Failed"
    assert policies.outcome({"conditions": failed["conditions"]}) is None  # InvalidSpec: not finished


def test_suspend_releases_every_pod_and_keeps_the_state() -> None:
    suspended = job(suspend=True, **EXPOSED)
    link = access.link(suspended, "research", {})
    objs = kinds(render.children(suspended, OWNER, TOKEN, started=True, finished=False, link=link))
    # No workload at all; the Services stay so the addresses (a load balancer's too) survive a resume.
    assert objs == STATE | {("Service", "demo-syncer"), ("Service", "demo-syncer-exposed")}
    # Resuming brings the syncer back on the same claim, where it restores its last checkpoint.
    resumed = by_key(render.children(job(**EXPOSED), OWNER, TOKEN, started=True, finished=False, link=link))
    volumes = resumed[("Deployment", "demo-syncer")]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "demo-checkpoints"}} in volumes
    (c,) = resumed[("Deployment", "demo-syncer")]["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--checkpoint-dir") + 1] == n.CHECKPOINT_DIR


def test_the_operator_manages_the_new_kinds() -> None:
    assert {"NetworkPolicy", "PodDisruptionBudget"} <= set(MANAGED_KINDS)
