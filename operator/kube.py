"""A small synchronous Kubernetes REST client for the operator's children.

kopf watches and patches the job itself; everything else goes through here. Why not the
generated `kubernetes` API classes: we need server-side apply and JSON merge patches on a few
kinds, which are three lines each as REST calls and version-specific keyword soup otherwise.
Credentials still come from the `kubernetes` package (in-cluster, then kubeconfig), the same
way kopf logs in, and bearer tokens are re-read per request so rotated tokens keep working.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from diloco.operator.render.naming import MANAGER

# kind -> (API prefix, plural); everything the operator reads or writes.
KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("api/v1", "configmaps"),
    "Secret": ("api/v1", "secrets"),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims"),
    "Service": ("api/v1", "services"),
    "Pod": ("api/v1", "pods"),
    "StatefulSet": ("apis/apps/v1", "statefulsets"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies"),  # who may reach a syncer
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),  # a drain waits for a syncer
    "GRPCRoute": ("apis/gateway.networking.k8s.io/v1", "grpcroutes"),  # an exposed syncer (Gateway API)
    # Kueue's (operator/kueue/integration.py): served under the newest version of VERSIONED's that the server has.
    "Workload": ("apis/kueue.x-k8s.io/v1beta2", "workloads"),  # a queued job's admission
    "ResourceFlavor": ("apis/kueue.x-k8s.io/v1beta2", "resourceflavors"),  # cluster-scoped: an admitted flavor
    "WorkloadPriorityClass": ("apis/kueue.x-k8s.io/v1beta2", "workloadpriorityclasses"),  # cluster-scoped
    "PriorityClass": ("apis/scheduling.k8s.io/v1", "priorityclasses"),  # cluster-scoped: a pod priority's value
    "DecoupledDiLoCoJob": ("apis/diloco.dev/v1alpha1", "decoupleddilocojobs"),
}
# Kinds an older server serves under an older version, newest first: policy/v1 PodDisruptionBudgets
# arrived in 1.21 (v1beta1, same fields for what we set, until 1.25). Chosen once per client.
OLDER_VERSIONS: dict[str, tuple[str, ...]] = {"PodDisruptionBudget": ("apis/policy/v1beta1",)}
# Kinds of API groups whose served version is found by group discovery (GET /apis/<group>): the
# newest served one of the versions the operator speaks, newest first. Kueue serves v1beta2
# from 0.15 on and drops v1beta1 later; older releases serve v1beta1 alone. Asked once per
# client, and again when a request says the version is no longer served (a Kueue upgrade).
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
VERSIONED: dict[str, tuple[str, tuple[str, ...]]] = {
    kind: (KUEUE_GROUP, KUEUE_VERSIONS) for kind in ("Workload", "ResourceFlavor", "WorkloadPriorityClass")}
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML


def load_configuration() -> Any:
    """In-cluster service account first, then $KUBECONFIG (read now, not at import) or ~/.kube/config."""
    import kubernetes.client
    import kubernetes.config

    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                           client_configuration=cfg)
    return cfg


def replica_agent(env: Mapping[str, str] = os.environ) -> str:
    """`diloco-operator (<pod>)` in a pod (the chart sets $POD_NAME), the manager's name alone elsewhere."""
    pod = env.get("POD_NAME")
    return f"{MANAGER} ({pod})" if pod else MANAGER


def bearer_token(cfg: Any) -> str | None:
    """The current token; calling the config's hook picks up rotated service-account tokens."""
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    return header.split(" ", 1)[-1] if header else None


class ApiError(RuntimeError):
    """A refused request: `status` (HTTP), and the API server's Status `reason` (Forbidden,
    Invalid, ...) and `detail` (its message alone) where it sent one."""

    def __init__(self, status: int, message: str, reason: str = "", detail: str = ""):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.reason, self.detail = status, reason, detail or message


class Kube:
    def __init__(self, host: str, *, token: str | Callable[[], str | None] | None = None, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None, verify: bool = True,
                 timeout: float = 30.0, user_agent: str = MANAGER):
        """`token` is a string or a callable returning the current one (rotated service-account tokens)."""
        self.host = host.rstrip("/")
        self._token = token
        self.user_agent = user_agent
        self.ca_file, self.cert_file, self.key_file, self.verify = ca_file, cert_file, key_file, verify
        self._served: dict[str, str] = {}  # kind -> prefix, for OLDER_VERSIONS
        self._group_versions: dict[str, str] = {}  # group -> the version spoken, for VERSIONED
        self.pool = urllib3.PoolManager(
            num_pools=4, maxsize=8, cert_reqs="CERT_REQUIRED" if verify else "CERT_NONE",
            ca_certs=ca_file, cert_file=cert_file, key_file=key_file,
            timeout=urllib3.Timeout(connect=5.0, read=timeout), retries=False)

    @classmethod
    def connect(cls, user_agent: str | None = None) -> Kube:
        """Logged in as the pod (or $KUBECONFIG); the User-Agent names the replica ($POD_NAME,
        from the downward API) so the audit log tells two operator replicas apart."""
        cfg = load_configuration()
        return cls(cfg.host, token=lambda: bearer_token(cfg), ca_file=cfg.ssl_ca_cert, cert_file=cfg.cert_file,
                   key_file=cfg.key_file, verify=cfg.verify_ssl, user_agent=user_agent or replica_agent())

    def token(self) -> str | None:
        """The current bearer token (re-read each time: service-account tokens rotate)."""
        return self._token() if callable(self._token) else self._token

    # -- raw ----------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, params: dict[str, str] | None = None,
                content_type: str = JSON) -> dict[str, Any]:
        url = f"{self.host}/{path}" + (f"?{urlencode(params)}" if params else "")
        headers = {"Accept": JSON, "User-Agent": self.user_agent}
        token = self.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        response = self.pool.request(method, url, body=data, headers=headers)
        text = response.data.decode("utf-8", "replace")
        if response.status >= 400:
            try:
                body = json.loads(text)
            except ValueError:
                body = None
            body = body if isinstance(body, dict) else {}
            message = str(body.get("message", text))
            raise ApiError(response.status, f"{method} {path}: {message}", str(body.get("reason") or ""), message)
        return json.loads(text) if text else {}

    def served_version(self, group: str, known: tuple[str, ...] = KUEUE_VERSIONS) -> str:
        """The newest of `known` (newest first) that the server serves for `group` (API discovery,
        asked once and cached); ApiError 404 naming what it serves when none of them."""
        if group not in self._group_versions:
            try:
                found = self.request("GET", f"apis/{group}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
                found = {}
            served = [str(v.get("version")) for v in found.get("versions") or []]
            chosen = next((v for v in known if v in served), None)
            if chosen is None:
                raise ApiError(404, f"the server serves no version of {group} this operator speaks "
                                    f"({', '.join(known)}); it serves {', '.join(served) or 'none'}", "NotServed")
            self._group_versions[group] = chosen
        return self._group_versions[group]

    def forget_version(self, group: str) -> None:
        """Discover `group`'s version again on next use."""
        self._group_versions.pop(group, None)

    def prefix(self, kind: str) -> str:
        """The API path prefix this server serves `kind` under (discovery, asked once)."""
        if kind in VERSIONED:
            group, known = VERSIONED[kind]
            return f"apis/{group}/{self.served_version(group, known)}"
        prefix, _ = KINDS[kind]
        if kind not in OLDER_VERSIONS:
            return prefix
        if kind not in self._served:
            for candidate in (prefix, *OLDER_VERSIONS[kind]):
                try:
                    self.request("GET", candidate)
                except ApiError as exc:
                    if exc.status == 404:
                        continue
                    raise
                self._served[kind] = candidate
                break
            else:
                raise ApiError(404, f"the server serves no version of {kind} (tried {prefix}, {OLDER_VERSIONS[kind]})")
        return self._served[kind]

    def _rediscovering(self, kind: str, call: Callable[[], dict[str, Any]], collection: bool = False) -> dict[str, Any]:
        """`call`, once more after discovering the version again when a VERSIONED kind's request
        answers 404 for the version rather than for an object (e.g. v1beta1 after a Kueue upgrade
        dropped it): any 404 of a `collection` (a list), else one without the Status reason
        NotFound that a missing object gets (an unserved path answers a bare 404 page)."""
        try:
            return call()
        except ApiError as exc:
            if exc.status != 404 or kind not in VERSIONED or exc.reason == "NotServed" or \
                    (exc.reason == "NotFound" and not collection):
                raise
            group = VERSIONED[kind][0]
            spoken = self._group_versions.pop(group, None)
            if spoken is None or self.served_version(group, VERSIONED[kind][1]) == spoken:
                raise
            return call()

    def path(self, kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = self.prefix(kind), KINDS[kind][1]
        out = f"{prefix}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{prefix}/{plural}"
        if name:
            out += f"/{quote(name)}"
        if sub:
            out += f"/{sub}"
        return out

    # -- verbs --------------------------------------------------------------------------------

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._rediscovering(kind, lambda: self.request("GET", self.path(kind, namespace, name)))
        except ApiError as exc:
            if exc.status == 404 and exc.reason != "NotServed":
                return None
            raise

    def list(self, kind: str, namespace: str | None, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))} if labels else None
        found = self._rediscovering(kind, lambda: self.request("GET", self.path(kind, namespace), params=params),
                                    collection=True)
        items: list[dict[str, Any]] = found.get("items") or []
        prefix = self.prefix(kind)
        for item in items:  # list items omit these; callers compare whole objects
            item.setdefault("apiVersion", prefix.removeprefix("apis/").removeprefix("api/"))
            item.setdefault("kind", kind)
        return items

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._rediscovering(obj["kind"], lambda: self.request(
            "POST", self.path(obj["kind"], obj["metadata"].get("namespace")), obj))

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates or updates, and drops fields we stopped setting."""
        meta = obj["metadata"]
        if obj["kind"] in OLDER_VERSIONS:  # rendered for the newest version; sent as the served one
            obj = {**obj, "apiVersion": self.prefix(obj["kind"]).removeprefix("apis/")}
        return self._rediscovering(obj["kind"], lambda: self.request(
            "PATCH", self.path(obj["kind"], meta["namespace"], meta["name"]), obj,
            params={"fieldManager": MANAGER, "force": "true"}, content_type=APPLY_PATCH))

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
              *, sub: str | None = None) -> dict[str, Any]:
        return self._rediscovering(kind, lambda: self.request("PATCH", self.path(kind, namespace, name, sub), patch,
                                                              content_type=MERGE_PATCH))

    def delete(self, kind: str, namespace: str, name: str, *, grace_seconds: int | None = None,
               uid: str | None = None) -> bool:
        """Delete in the background (dependants are garbage-collected); False if already gone.

        `uid` is a precondition: never delete a newer object that reuses the name.
        """
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        params = {"gracePeriodSeconds": str(grace_seconds)} if grace_seconds is not None else None
        try:
            self._rediscovering(kind, lambda: self.request("DELETE", self.path(kind, namespace, name), body,
                                                           params=params))
        except ApiError as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True
