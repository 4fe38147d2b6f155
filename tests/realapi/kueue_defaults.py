"""Kueue's default integrations, played on the real API server: its statefulset and deployment
webhooks' defaulting, and the Workload its integrations then make for what they took.

Kueue's shipped configuration enables the `pod`, `deployment` and `statefulset` integrations.
Written from kubernetes-sigs/kueue (main as of 2026-08):

- pkg/controller/jobs/statefulset/statefulset_webhook.go, `Default`: nothing when the pod
  template names another framework as its suspending parent (managedByAnotherFramework: the
  `kueue.x-k8s.io/pod-suspending-parent` annotation with another value); else
  ApplyDefaultLocalQueue (pkg/controller/jobframework/defaults.go): when the namespace has a
  LocalQueue named `default`, the object has no queue name, and its controller owner's kind is not
  one Kueue manages (a built-in integration, or one of `integrations.externalFrameworks`, given as
  `Kind.version.group`: IsOwnerManagedByKueueForObject), the label
  `kueue.x-k8s.io/queue-name: default`; then, queued (WorkloadShouldBeSuspended), the template's
  `kueue.x-k8s.io/pod-suspending-parent: statefulset`.
- pkg/controller/jobs/deployment/deployment_webhook.go, `Default`: the same defaulting, then the
  template's suspending parent `deployment`, the managed label and the queue name.
- the integrations then hold the pods and admit them through a Workload of their own (`step`:
  one Workload per labelled StatefulSet or Deployment, owned by it), so the job's quota is
  counted twice.

Namespaces are all managed (managedJobsNamespaceSelector's default leaves out only kube-system
and kueue-system) and manageJobsWithoutQueueName is off, as shipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from diloco.operator.kube import ApiError, Kube

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SUSPENDING_PARENT = "kueue.x-k8s.io/pod-suspending-parent"
MANAGED = ("kueue.x-k8s.io/managed", "true")
DEFAULT_QUEUE = "default"
# The owners Kueue's built-in integrations know (their GVKs), besides externalFrameworks.
BUILT_IN = {"batch/v1/Job", "jobset.x-k8s.io/v1alpha2/JobSet", "apps/v1/StatefulSet", "apps/v1/Deployment",
            "kubeflow.org/v1/PyTorchJob", "kubeflow.org/v1/TFJob", "ray.io/v1/RayJob", "ray.io/v1/RayCluster",
            "trainer.kubeflow.org/v1alpha1/TrainJob", "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet"}


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _put(obj: dict[str, Any], path: list[str], key: str, value: str) -> list[dict[str, Any]]:
    """JSON patch operations setting obj[path...][key] = value."""
    node: Any = obj
    for i, part in enumerate(path):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            return [{"op": "add", "path": "/" + "/".join(path[:i + 1]),
                     "value": _nest(path[i + 1:], {key: value})}]
        node = node[part]
    return [{"op": "add", "path": "/" + "/".join([*path, _escape(key)]), "value": value}]


def _nest(path: list[str], leaf: dict[str, Any]) -> dict[str, Any]:
    out = leaf
    for part in reversed(path):
        out = {part: out}
    return out


class Defaults:
    """The defaulting webhooks (`mutators`, for tests/realapi/admission.py) and the integrations'
    Workloads (`step`); `external_frameworks`: Kueue's integrations.externalFrameworks."""

    def __init__(self, api: Kube | None, *, version: str = "v1beta1", external_frameworks: Iterable[str] = ()) -> None:
        self.api, self.version = api, version
        self.external_frameworks = set(external_frameworks)
        self.log: list[tuple[str, str]] = []

    def _default_queue_exists(self, namespace: str) -> bool:
        if self.api is None:  # the lane is still being set up (the chart's own Deployment)
            return False
        try:
            self.api.request("GET", f"apis/kueue.x-k8s.io/{self.version}/namespaces/{namespace}/localqueues/"
                                    f"{DEFAULT_QUEUE}")
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _owner_known(self, obj: dict[str, Any]) -> bool:
        """IsOwnerManagedByKueueForObject: the controller owner's kind is an integration's."""
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
            if not ref.get("controller"):
                continue
            gvk = f"{ref.get('apiVersion')}/{ref.get('kind')}"
            group, _, version = str(ref.get("apiVersion", "")).rpartition("/")
            return gvk in BUILT_IN or f"{ref.get('kind')}.{version}.{group}" in self.external_frameworks
        return False

    def _local_queue(self, obj: dict[str, Any], namespace: str) -> list[dict[str, Any]]:
        """ApplyDefaultLocalQueue."""
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(QUEUE_LABEL) or not self._default_queue_exists(namespace) or self._owner_known(obj):
            return []
        return _put(obj, ["metadata", "labels"], QUEUE_LABEL, DEFAULT_QUEUE)

    def _queued(self, obj: dict[str, Any], ops: list[dict[str, Any]]) -> bool:
        return bool(ops) or bool(((obj.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL))

    def statefulset(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        sts = req["object"]
        parent = ((sts["spec"].get("template") or {}).get("metadata") or {}).get("annotations", {}).get(
            SUSPENDING_PARENT)
        if parent is not None and parent != "statefulset":  # managedByAnotherFramework
            return []
        ops = self._local_queue(sts, req["namespace"])
        if self._queued(sts, ops):
            ops += _put(sts, ["spec", "template", "metadata", "annotations"], SUSPENDING_PARENT, "statefulset")
            self.log.append(("statefulset", sts["metadata"]["name"]))
        return ops

    def deployment(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        deploy = req["object"]
        ops = self._local_queue(deploy, req["namespace"])
        if self._queued(deploy, ops):
            queue = ((deploy["metadata"].get("labels") or {}).get(QUEUE_LABEL)) or DEFAULT_QUEUE
            ops += _put(deploy, ["spec", "template", "metadata", "annotations"], SUSPENDING_PARENT, "deployment")
            # A Deployment's template always has labels (its selector's).
            ops += [{"op": "add", "path": f"/spec/template/metadata/labels/{_escape(key)}", "value": value}
                    for key, value in (MANAGED, (QUEUE_LABEL, queue))]
            self.log.append(("deployment", deploy["metadata"]["name"]))
        return ops

    def mutators(self) -> dict[str, tuple[str, list[str], Any]]:
        return {"/kueue/mutate-statefulset": ("apps", ["statefulsets"], self.statefulset),
                "/kueue/mutate-deployment": ("apps", ["deployments"], self.deployment)}

    def step(self, namespace: str) -> list[dict[str, Any]]:
        """The integrations' part: a Workload for each labelled StatefulSet and Deployment that has
        none yet (what Kueue would admit, and gate their pods on); the Workloads it made."""
        assert self.api is not None
        made = []
        for kind in ("StatefulSet", "Deployment"):
            for obj in self.api.list(kind, namespace):
                meta = obj["metadata"]
                queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
                if not queue:
                    continue
                name = f"{kind.lower()}-{meta['name']}"[:63]
                if self.api.get("Workload", namespace, name) is not None:
                    continue
                template = obj["spec"]["template"]
                made.append(self.api.create({
                    "apiVersion": f"kueue.x-k8s.io/{self.version}", "kind": "Workload",
                    "metadata": {"name": name, "namespace": namespace,
                                 "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind, "name": meta["name"],
                                                      "uid": meta["uid"], "controller": True}]},
                    "spec": {"queueName": queue, "podSets": [{"name": "main", "count": int(obj["spec"].get(
                        "replicas", 1)), "template": {"metadata": {"labels": template["metadata"].get("labels") or {}},
                                                      "spec": {"containers": [
                                                          {"name": c["name"], "image": c.get("image", "")}
                                                          for c in template["spec"]["containers"]]}}}]}}))
                self.log.append(("workload", name))
        return made
