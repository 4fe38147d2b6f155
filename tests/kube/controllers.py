"""The cluster's controllers for tests: StatefulSet, Deployment, garbage collector and kubelet.

kmock runs no controllers (docs/DEVELOPMENT.md, "Kubernetes in tests"), so this plays them, over the API like the real ones:
StatefulSets get `<name>-<ordinal>` pods with the pod-index label (Parallel policy, pods
replaced when their template changes), Deployments get Recreate-style pods, owner references
cascade deletions, and a kubelet runs pods through a `Runtime` (no processes by default;
the full-system test starts real ones) and finishes graceful deletions.
"""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
import threading
from typing import Any

from diloco.operator.kube import ApiError, Kube
from diloco.operator.render import naming as n

REVISION = "controller-revision-hash"
GC_KINDS = ("StatefulSet", "Deployment", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim", "Pod",
            "NetworkPolicy", "PodDisruptionBudget")
OWNER_KINDS = ("DecoupledDiLoCoJob", "StatefulSet", "Deployment")


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def set_ready(api: Kube, pod: dict[str, Any], ready: bool = True) -> None:
    """What the kubelet reports once the readiness probe passes (or fails)."""
    meta = pod["metadata"]
    value = "True" if ready else "False"
    containers = [{"name": c["name"], "ready": ready, "restartCount": 0, "state": {"running": {}}}
                  for c in pod["spec"]["containers"]]
    old = {c["name"]: c for c in (pod.get("status") or {}).get("containerStatuses") or []}
    for c in containers:
        c.update({k: v for k, v in old.get(c["name"], {}).items() if k in ("restartCount", "lastState")})
    api.patch("Pod", meta["namespace"], meta["name"], {"status": {
        "phase": "Running", "podIP": "127.0.0.1", "containerStatuses": containers,
        "conditions": [{"type": "Ready", "status": value}, {"type": "ContainersReady", "status": value}]}},
        sub="status")


class Runtime:
    """Containers without processes: a pod is ready as soon as `auto_ready` allows."""

    def __init__(self) -> None:
        self.auto_ready = True

    def start(self, pod: dict[str, Any]) -> None:
        pass

    def ready(self, pod: dict[str, Any]) -> bool:
        return self.auto_ready

    def stop(self, pod: dict[str, Any]) -> bool:
        """Stop the pod's containers (SIGTERM first); True once they are gone."""
        return True

    def exited(self, pod: dict[str, Any]) -> int | None:
        """The container's exit code once it has exited by itself; None while it runs."""
        return None

    def message(self, pod: dict[str, Any]) -> str:
        """The termination message the container's latest start left (its terminationMessagePath)."""
        return ""

    def kill(self, pod: dict[str, Any], sig: int) -> None:
        """Send the running container `sig` (a kubelet killing it for a failed liveness probe)."""

    def close(self) -> None:
        pass


class Controllers:
    def __init__(self, api: Kube, namespace: str, runtime: Runtime | None = None, period: float = 0.1):
        self.api, self.namespace, self.period = api, namespace, period
        self.runtime = runtime or Runtime()
        self.finalize_deletions = True  # False: a dead node, pods stay Terminating
        self.started: set[str] = set()  # pod uids the kubelet has started
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="controllers", daemon=True)

    def __enter__(self) -> Controllers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.runtime.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.step()
            except ApiError as exc:  # races with the operator (409, 404) resolve next round
                self.errors.append(str(exc))

    def step(self) -> None:
        self.collect_garbage()
        for sts in self.api.list("StatefulSet", self.namespace):
            self.statefulset(sts)
        for deploy in self.api.list("Deployment", self.namespace):
            self.deployment(deploy)
        for pod in self.api.list("Pod", self.namespace):
            self.kubelet(pod)

    # -- garbage collector ------------------------------------------------------------------

    def collect_garbage(self) -> None:
        alive = {o["metadata"]["uid"] for kind in OWNER_KINDS for o in self.api.list(kind, self.namespace)}
        for kind in GC_KINDS:
            for obj in self.api.list(kind, self.namespace):
                refs = obj["metadata"].get("ownerReferences") or []
                if refs and not any(r["uid"] in alive for r in refs) and not obj["metadata"].get("deletionTimestamp"):
                    self.api.delete(kind, self.namespace, obj["metadata"]["name"], uid=obj["metadata"]["uid"])

    # -- workload controllers ---------------------------------------------------------------

    def _owned_pods(self, owner: dict[str, Any]) -> list[dict[str, Any]]:
        uid = owner["metadata"]["uid"]
        return [p for p in self.api.list("Pod", self.namespace)
                if any(r["uid"] == uid for r in p["metadata"].get("ownerReferences") or [])]

    def _new_pod(self, owner: dict[str, Any], name: str, extra_labels: dict[str, str]) -> dict[str, Any]:
        template = copy.deepcopy(owner["spec"]["template"])
        meta = template.get("metadata") or {}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": self.namespace,
            "labels": {**(meta.get("labels") or {}), **extra_labels},
            "annotations": meta.get("annotations") or {},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": owner["kind"], "name": owner["metadata"]["name"],
                                 "uid": owner["metadata"]["uid"], "controller": True}]},
            "spec": template["spec"]}

    def _status(self, owner: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = sum(1 for p in live if is_ready(p))
        status = {"observedGeneration": owner["metadata"].get("generation", 1), "replicas": len(live),
                  "readyReplicas": ready, "availableReplicas": ready}
        if {k: (owner.get("status") or {}).get(k) for k in status} != status:
            self.api.patch(owner["kind"], self.namespace, owner["metadata"]["name"], {"status": status}, sub="status")

    def statefulset(self, sts: dict[str, Any]) -> None:
        name, replicas = sts["metadata"]["name"], int(sts["spec"].get("replicas", 1))
        revision = template_hash(sts["spec"]["template"])
        pods = self._owned_pods(sts)
        by_name = {p["metadata"]["name"]: p for p in pods}
        for pod in pods:
            ordinal = int(pod["metadata"]["labels"].get(n.INDEX, "-1"))
            outdated = pod["metadata"]["labels"].get(REVISION) != revision
            if (ordinal >= replicas or outdated) and not pod["metadata"].get("deletionTimestamp"):
                self.api.delete("Pod", self.namespace, pod["metadata"]["name"], uid=pod["metadata"]["uid"])
        for i in range(replicas):
            if f"{name}-{i}" not in by_name:
                self.api.create(self._new_pod(sts, f"{name}-{i}", {
                    n.INDEX: str(i), REVISION: revision, "statefulset.kubernetes.io/pod-name": f"{name}-{i}"}))
        self._status(sts, pods)

    def deployment(self, deploy: dict[str, Any]) -> None:
        revision = template_hash(deploy["spec"]["template"])
        pods = self._owned_pods(deploy)
        current = [p for p in pods if p["metadata"]["labels"].get("pod-template-hash") == revision]
        for pod in pods:
            if pod not in current and not pod["metadata"].get("deletionTimestamp"):
                self.api.delete("Pod", self.namespace, pod["metadata"]["name"], uid=pod["metadata"]["uid"])
        live_current = [p for p in current if not p["metadata"].get("deletionTimestamp")]
        if len(pods) == len(current):  # Recreate: new pods only once the old ones are gone
            for _ in range(int(deploy["spec"].get("replicas", 1)) - len(live_current)):
                name = f"{deploy['metadata']['name']}-{revision}-{secrets.token_hex(3)}"
                self.api.create(self._new_pod(deploy, name, {"pod-template-hash": revision}))
        self._status(deploy, pods)

    # -- kubelet ----------------------------------------------------------------------------

    def gated(self, pod: dict[str, Any]) -> None:
        """What the kube-scheduler (1.27+) does with a pod that has scheduling gates: it does not
        place it, and says so in PodScheduled; the kubelet never sees it."""
        conds = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "PodScheduled" and c.get("reason") == "SchedulingGated" for c in conds):
            return
        meta = pod["metadata"]
        self.api.patch("Pod", meta["namespace"], meta["name"], {"status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
             "message": "Scheduling is blocked due to non-empty scheduling gates",
             "lastTransitionTime": meta.get("creationTimestamp")}]}}, sub="status")

    def kubelet(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            if self.finalize_deletions and self.runtime.stop(pod):
                self.started.discard(meta["uid"])
                self.api.delete("Pod", self.namespace, meta["name"], grace_seconds=0, uid=meta["uid"])
            return
        if pod["spec"].get("schedulingGates"):
            self.gated(pod)
            return
        if meta["uid"] not in self.started:
            self.started.add(meta["uid"])
            self.runtime.start(pod)
            set_ready(self.api, pod, False)
            return
        if not is_ready(pod) and self.runtime.ready(pod):
            set_ready(self.api, pod, True)
