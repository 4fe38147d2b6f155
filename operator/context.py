"""What every handler shares: settings, the API client, syncer channels, metrics and locks.

One `Context` lives in kopf's memo. Handlers of one job (its own events, its timers and its
pods' events) run concurrently in kopf's threads; they serialise on the job's lock so each
read-modify-write of the status sees the previous one.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from diloco.operator.admission.certificates import WebhookOptions
from diloco.operator.failures.capacity import GATE_GRACE
from diloco.operator.failures.policy import IMAGE_PULL_GRACE
from diloco.operator.kube import Kube, replica_agent
from diloco.operator.metrics import OperatorMetrics
from diloco.operator.reconcile.children import GATEWAY_KINDS, KUEUE_KINDS, MANAGED_KINDS
from diloco.operator.remote.clients import Clients
from diloco.operator.render import naming
from diloco.operator.render.policies import OPERATOR_LABELS, Peers
from diloco.operator.syncer_client import SyncerClients


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_annotations(name: str) -> dict[str, str]:
    """A JSON object of string values (the chart writes it with toJson), or a clear error at start."""
    raw = os.environ.get(name) or "{}"
    value = json.loads(raw)
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"${name}: expected a JSON object of strings, got {raw!r}")
    return value


def _env_peers() -> Peers:
    """Who may reach job syncers besides their learners: the chart names the operator's own
    namespace and pod labels, and the metrics scrapers (a JSON list of NetworkPolicyPeers)."""
    raw = os.environ.get("DILOCO_METRICS_FROM")
    metrics = json.loads(raw) if raw else list(Peers.metrics_from)
    if not isinstance(metrics, list) or not all(isinstance(p, dict) for p in metrics):
        raise ValueError(f"$DILOCO_METRICS_FROM: expected a JSON list of NetworkPolicyPeers, got {raw!r}")
    return Peers(operator_namespace=os.environ.get("DILOCO_OPERATOR_NAMESPACE") or None,
                 operator_labels=_env_annotations("DILOCO_OPERATOR_LABELS") or dict(OPERATOR_LABELS),
                 metrics_from=tuple(metrics))


@dataclass(frozen=True)
class Config:
    """Operator settings; the environment overrides the defaults (the Helm chart sets them)."""

    status_interval: float = 10.0  # seconds between status refreshes (and the Status RPC)
    chaos_interval: float = 2.0  # how finely chaos follows its schedule
    stuck_timeout: float = 120.0  # seconds past a pod's grace period before it is force-deleted
    # Seconds every pod of a group may be stuck pulling its image before the job ends
    # (failures.image_stuck). Not an environment setting: tests shorten it.
    image_pull_grace: float = IMAGE_PULL_GRACE
    # Seconds a pod may stay behind a scheduling gate before the job shows it (operator/failures/capacity.py).
    # Not an environment setting: tests shorten it.
    gate_grace: float = GATE_GRACE
    # Where the operator dials a job's syncer; tests map Service names to local ports.
    syncer_address: Callable[[str, str], str] = naming.syncer_address
    # The chart's syncerExposure: may the operator manage GRPCRoutes (Gateway API CRDs and RBAC
    # present), and annotations every exposed syncer gets (a job's own override them).
    gateway_api: bool = False
    expose_annotations: dict[str, str] = field(default_factory=dict)
    # Who besides a job's learners may reach its syncer (its NetworkPolicy); the chart's values.
    peers: Peers = field(default_factory=Peers)
    # The chart's kueue.enabled: the operator is the Kueue integration of queue-labelled jobs
    # (their Workloads: operator/kueue/integration.py); the Workload CRD and RBAC for it must be there.
    kueue: bool = False
    # The validating admission webhook (operator/admission/webhook.py): where kopf serves it and whence its
    # certificate; None (no DILOCO_WEBHOOK_PORT): not served, as in tests that do not ask for it.
    webhook: WebhookOptions | None = None

    @classmethod
    def from_env(cls) -> Config:
        return cls(status_interval=_env_float("DILOCO_STATUS_INTERVAL_SECONDS", cls.status_interval),
                   chaos_interval=_env_float("DILOCO_CHAOS_INTERVAL_SECONDS", cls.chaos_interval),
                   stuck_timeout=_env_float("DILOCO_STUCK_POD_TIMEOUT_SECONDS", cls.stuck_timeout),
                   gateway_api=os.environ.get("DILOCO_GATEWAY_API", "false").lower() == "true",
                   expose_annotations=_env_annotations("DILOCO_EXPOSE_ANNOTATIONS"),
                   kueue=os.environ.get("DILOCO_KUEUE", "false").lower() == "true",
                   peers=_env_peers(), webhook=WebhookOptions.from_env())

    @property
    def managed_kinds(self) -> tuple[str, ...]:
        return MANAGED_KINDS + (GATEWAY_KINDS if self.gateway_api else ()) + (KUEUE_KINDS if self.kueue else ())


@dataclass
class Context:
    config: Config
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    syncers: SyncerClients = field(default_factory=SyncerClients)
    remotes: Clients = field(default_factory=lambda: Clients(replica_agent()))  # remote clusters' API clients
    kube: Kube | None = None  # connected by the startup handler
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    @property
    def api(self) -> Kube:
        if self.kube is None:
            raise RuntimeError("the Kubernetes client is not connected yet")
        return self.kube

    def connect(self) -> Kube:
        """The API client, connected on first use (kopf's login and startup race for it)."""
        with self._guard:
            if self.kube is None:
                self.kube = Kube.connect()
            return self.kube

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._locks.pop((namespace, name), None)
        self.syncers.forget(namespace, name)
        self.metrics.forget(namespace, name)


def post(ref: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
    """A Kubernetes Event about the job (seen in `kubectl describe ddj`)."""
    body = cast(kopf.Body, ref)  # kopf reads apiVersion, kind and metadata from any mapping
    kopf.event(body, type="Warning" if warning else "Normal", reason=reason, message=message[:1000])
