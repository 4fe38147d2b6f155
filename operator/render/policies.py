"""Pure `spec -> manifests` for what guards a job rather than runs it: who may reach the syncer
(a NetworkPolicy), that a node drain waits for it (a PodDisruptionBudget), whether the trained
model outlives the job (checkpointRetention) and which pods a finished job keeps (cleanPodPolicy).

Split from operator/render/job.py, which decides when each of these exists; both are pure and tested
without a cluster. The operator's own whereabouts (its namespace and pod labels, who scrapes
metrics) come from the chart through `Peers`, since no manifest can know them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from diloco.contract import SYNCER_GRPC_PORT, SYNCER_METRICS_PORT
from diloco.operator.render import naming as n
from diloco.operator.render.parts import Owner, meta
from diloco.operator.status import conditions as c
from diloco.spec import DecoupledDiLoCoJob, JobSpec

Outcome = Literal["Succeeded", "Failed"]
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace (1.21+)
# The chart's operator pod labels (diloco.selectorLabels) without the release's instance label.
OPERATOR_LABELS: Mapping[str, str] = {"app.kubernetes.io/name": "decoupled-diloco",
                                      "app.kubernetes.io/component": "operator"}


@dataclass(frozen=True)
class Peers:
    """Who besides the job's learners may open connections to its syncer pods."""

    # The operator dials every syncer's gRPC port for its Status RPC. None (the operator runs
    # outside a chart, e.g. in tests): pods with its labels in any namespace.
    operator_namespace: str | None = None
    operator_labels: Mapping[str, str] = field(default_factory=lambda: dict(OPERATOR_LABELS))
    # NetworkPolicyPeers that may scrape the syncer's metrics port. Default: any pod in the
    # cluster (Prometheus's namespace is the installer's choice, and metrics carry no token);
    # nothing outside it. An empty list admits nobody.
    metrics_from: tuple[dict[str, Any], ...] = ({"namespaceSelector": {}},)


def operator_peer(peers: Peers) -> dict[str, Any]:
    namespaces = ({"matchLabels": {NAMESPACE_LABEL: peers.operator_namespace}}
                  if peers.operator_namespace else {})
    return {"namespaceSelector": namespaces, "podSelector": {"matchLabels": dict(peers.operator_labels)}}


def network_policy(job: DecoupledDiLoCoJob, owner: Owner, peers: Peers) -> dict[str, Any]:
    """Ingress to the syncer pods: gRPC from this job's learners and the operator, metrics from
    `peers.metrics_from`, nothing else. An exposed syncer's gRPC port (every shard pod's, for a
    sharded one: the policy selects them all) takes any source: its clients come through a load
    balancer or a Gateway whose addresses no policy can name (a LoadBalancer Service with
    externalTrafficPolicy Cluster even hides them behind node addresses); the job token and the
    syncer's TLS guard it, and loadBalancerSourceRanges narrow it at the load balancer. Egress
    stays open (the syncer dials nothing but DNS)."""
    grpc = {"port": SYNCER_GRPC_PORT, "protocol": "TCP"}
    learners = {"podSelector": {"matchLabels": n.selector(owner.name, n.LEARNER)}}  # this namespace only
    rules: list[dict[str, Any]] = [
        {"ports": [grpc]} if job.spec.syncer.expose is not None else
        {"from": [learners, operator_peer(peers)], "ports": [grpc]}]
    if peers.metrics_from:  # a rule without `from` would admit every source
        rules.append({"from": [dict(p) for p in peers.metrics_from],
                      "ports": [{"port": SYNCER_METRICS_PORT, "protocol": "TCP"}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": meta(owner, n.syncer_policy(owner.name), n.SYNCER),
            "spec": {"podSelector": {"matchLabels": n.selector(owner.name, n.SYNCER)},
                     "policyTypes": ["Ingress"], "ingress": rules}}


def disruption_budget(owner: Owner) -> dict[str, Any]:
    """No voluntary eviction of a syncer pod: a drain waits instead. Every learner stalls at its
    next sync while the syncer is away, and a big model's checkpoint takes minutes to restore;
    the drain's owner decides (suspend the job, or delete this budget). maxUnavailable 0 rather
    than minAvailable = shards: the same for one pod or a shard per pod, with no count to keep
    in step. Rendered only while the syncer runs, so a finished or suspended job blocks nothing."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(owner, n.syncer_policy(owner.name), n.SYNCER),
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": n.selector(owner.name, n.SYNCER)}}}


def retained(spec: JobSpec, obj: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint claim under the job's retention: Retain drops the owner reference, so neither
    the garbage collector (job deleted) nor the operator's pruning (it deletes only what the job
    owns) ever removes it; Delete keeps it, and the claim goes with the job."""
    if spec.run_policy.checkpoint_retention == "Delete":
        return obj
    metadata = {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}
    return {**obj, "metadata": metadata}


def keeps_syncer(spec: JobSpec, outcome: Outcome | None) -> bool:
    """Whether a finished job's syncer stays (cleanPodPolicy); its learners stay only with None."""
    policy = spec.run_policy.clean_pod_policy
    return policy == "None" or (policy == "Running" and outcome == "Failed")


def outcome(status: Mapping[str, Any]) -> Outcome | None:
    """How a finished job ended, from its conditions; None while it has not."""
    conds = list(status.get("conditions") or [])
    if c.is_true(conds, c.SUCCEEDED):
        return "Succeeded"
    return "Failed" if c.is_true(conds, c.FAILED) and status.get("completionTime") else None
