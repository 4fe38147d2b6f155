"""A test-side kubelet for the real control plane: one Node, its pods run through a `Runtime`.

The real kube-scheduler binds pods to the Node this registers; the real controllers create and
replace them; this plays the kubelet's part over the API, as the real one does: node status
and heartbeats, pod phases and conditions, container states with exit codes and restart counts
(restartPolicy Always with back-off, what StatefulSet and Deployment pods have), each exit's
termination message (the last 4096 bytes of the file the start had at its terminationMessagePath,
in `lastState.terminated.message`), a failed liveness probe's kill (`fail_liveness`: SIGTERM,
SIGKILL after the pod's grace period, then the restart), image pull failures for images it
cannot "pull", and graceful deletion (SIGTERM, then the pod object goes). Its API server paused
or down, it retries and the pods run on; a pod's readiness another wrote over meanwhile (the node
controller marks a silent node's pods NotReady) is written again.
It also plays the volume provisioner the control plane lacks: every pending claim gets a
hostPath PersistentVolume, which the real persistent-volume controller binds.
Several may share one runtime (one machine), each its own Node (`node`, with `labels` such as a
zone: tests/realapi/test_standby_takeover.py runs two zones so).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import urllib3

from diloco.operator.kube import ApiError, Kube
from tests.kube.controllers import Runtime
from tests.kube.processes import VolumeMissing

NODE = "diloco-node-0"
HEARTBEAT = 5.0  # seconds; the controller-manager's grace period is 20 s (tests/realapi/controlplane.py)


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    """What this kubelet remembers about a pod's one container."""

    restarts: int = 0
    last_exit: int | None = None
    last_message: str = ""  # the termination message of the last exit
    killed_at: float | None = None  # when a failed liveness probe had it sent SIGTERM
    running: bool = False
    back_off_until: float = 0.0
    ready: bool = False
    pull_error: str | None = None


@dataclass
class Kubelet:
    """`with Kubelet(api, runtime):` registers the node and runs its pods until the block ends."""

    api: Kube
    runtime: Runtime
    pullable: Callable[[str], bool] = lambda image: True
    volumes: str = "/tmp/diloco-realapi-volumes"
    # Pods of other namespaces are bound here but never started (the runtime serves one namespace).
    namespaces: frozenset[str] | None = None
    period: float = 0.2
    node: str = NODE
    labels: dict[str, str] = field(default_factory=dict)  # the Node's, besides hostname, os and arch
    errors: list[str] = field(default_factory=list)
    pods: dict[str, Container] = field(default_factory=dict)  # by pod uid
    liveness_failed: set[tuple[str, str]] = field(default_factory=set)  # (namespace, pod name) to kill once

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{self.node}", daemon=True)
        self._beat = 0.0

    def __enter__(self) -> Kubelet:
        self._register()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.runtime.close()

    # -- node ---------------------------------------------------------------------------------

    def _register(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": {
            "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            **self.labels}}}
        try:
            self.api.request("POST", "api/v1/nodes", node)
        except ApiError as exc:
            if exc.status != 409:
                raise
        self._heartbeat()

    def _heartbeat(self) -> None:
        t = now()
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "500Gi"}
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test-side kubelet",
                 "lastHeartbeatTime": t, "lastTransitionTime": t}
        self.api.request("PATCH", f"api/v1/nodes/{self.node}/status", {"status": {
            "capacity": capacity, "allocatable": capacity, "conditions": [ready],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.node}],
            "nodeInfo": {"kubeletVersion": "v1.20.2", "containerRuntimeVersion": "diloco-tests://1",
                         "operatingSystem": "linux", "architecture": "amd64", "kernelVersion": "", "osImage": "",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}}},
            content_type="application/merge-patch+json")
        self._beat = time.monotonic()

    def fail_liveness(self, namespace: str, name: str) -> None:
        """Act as on a failed liveness probe of the pod's container (the test stands in for the
        probe): SIGTERM it, SIGKILL it after the pod's terminationGracePeriodSeconds, and restart it."""
        self.liveness_failed.add((namespace, name))

    # -- loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                if time.monotonic() - self._beat >= HEARTBEAT:
                    self._heartbeat()
                self._provision()
                pods = self.api.request("GET", "api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.node}"})
                for pod in pods.get("items") or []:
                    if self.namespaces is None or pod["metadata"]["namespace"] in self.namespaces:
                        self._sync(pod)
            except ApiError as exc:  # races with the controllers (409, 404) resolve next round
                self.errors.append(str(exc))
            except (urllib3.exceptions.HTTPError, OSError) as exc:  # the API server down or paused: retried,
                self.errors.append(f"{type(exc).__name__}: {exc}")  # the pods running on meanwhile

    def _provision(self) -> None:
        claims = self.api.request("GET", "api/v1/persistentvolumeclaims").get("items") or []
        for claim in claims:
            meta, spec = claim["metadata"], claim["spec"]
            if spec.get("volumeName") or (claim.get("status") or {}).get("phase") != "Pending":
                continue
            name = f"pv-{meta['uid'][:13]}"
            volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": {
                "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                "storageClassName": spec.get("storageClassName") or "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"{self.volumes}/{meta['namespace']}/{meta['name']}"},
                "claimRef": {"namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]}}}
            try:
                self.api.request("POST", "api/v1/persistentvolumes", volume)
            except ApiError as exc:
                if exc.status != 409:
                    raise

    # -- pods ---------------------------------------------------------------------------------

    def _sync(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        if meta.get("deletionTimestamp"):
            if self.runtime.stop(pod):
                self.pods.pop(uid, None)
                self.api.delete("Pod", meta["namespace"], meta["name"], grace_seconds=0, uid=uid)
            return
        state = self.pods.get(uid)
        if state is None:
            state = self.pods[uid] = Container()
            image = pod["spec"]["containers"][0]["image"]
            if not self.pullable(image):
                state.pull_error = f'failed to pull image "{image}": not found in the test-side kubelet\'s store'
                self._report(pod, state)
                return
            try:
                self._start(pod, state)
            except VolumeMissing:  # retried next round, as the kubelet retries a mount
                self.pods.pop(uid, None)
            return
        if state.pull_error:
            return
        code = self.runtime.exited(pod) if state.running else None
        if code is None and state.running:
            self._liveness(pod, state)
        if code is not None:
            state.running, state.ready, state.last_exit = False, False, code
            state.last_message, state.killed_at = self.runtime.message(pod), None
            state.back_off_until = time.monotonic() + min(10.0, 1.0 * 2 ** state.restarts)
            self._report(pod, state)
        elif not state.running and time.monotonic() >= state.back_off_until:
            state.restarts += 1
            self._start(pod, state)
        elif state.running and not state.ready and state.killed_at is None and self.runtime.ready(pod):
            state.ready = True
            self._report(pod, state)
        elif state.running and self._shown_ready(pod) != state.ready:
            # Another wrote over the status (the node controller marks a node's pods NotReady when
            # its heartbeats stopped reaching a paused API server): written again, as the kubelet's
            # status manager does.
            self._report(pod, state)

    @staticmethod
    def _shown_ready(pod: dict[str, Any]) -> bool:
        conditions = (pod.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def _liveness(self, pod: dict[str, Any], state: Container) -> None:
        meta = pod["metadata"]
        if (meta["namespace"], meta["name"]) in self.liveness_failed:
            self.liveness_failed.discard((meta["namespace"], meta["name"]))
            state.killed_at, state.ready = time.monotonic(), False
            self.runtime.kill(pod, signal.SIGTERM)
            self._report(pod, state)
        elif state.killed_at is not None and \
                time.monotonic() - state.killed_at > pod["spec"].get("terminationGracePeriodSeconds", 30):
            self.runtime.kill(pod, signal.SIGKILL)

    def _start(self, pod: dict[str, Any], state: Container) -> None:
        self.runtime.start(pod)
        state.running = True
        self._report(pod, state)

    def _report(self, pod: dict[str, Any], state: Container) -> None:
        """The pod's status as a kubelet writes it."""
        meta, (container,) = pod["metadata"], pod["spec"]["containers"]
        t = now()
        if state.pull_error:
            current: dict[str, Any] = {"waiting": {"reason": "ErrImagePull", "message": state.pull_error}}
        elif state.running:
            current = {"running": {"startedAt": t}}
        else:
            current = {"waiting": {"reason": "CrashLoopBackOff",
                                   "message": f"back-off restarting failed container (exit code {state.last_exit})"}}
        status: dict[str, Any] = {"name": container["name"], "image": container["image"], "imageID": "",
                                  "ready": state.ready, "restartCount": state.restarts, "started": state.running,
                                  "state": current}
        if state.last_exit is not None:
            ended: dict[str, Any] = {"exitCode": state.last_exit, "finishedAt": t,
                                     "reason": "Completed" if state.last_exit == 0 else "Error"}
            if state.last_message:
                ended["message"] = state.last_message
            status["lastState"] = {"terminated": ended}
        value = "True" if state.ready else "False"
        patch = {"status": {
            "phase": "Running" if not state.pull_error else "Pending", "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "startTime": (pod.get("status") or {}).get("startTime") or t, "containerStatuses": [status],
            "conditions": [{"type": "Initialized", "status": "True", "lastTransitionTime": t},
                           {"type": "Ready", "status": value, "lastTransitionTime": t},
                           {"type": "ContainersReady", "status": value, "lastTransitionTime": t},
                           {"type": "PodScheduled", "status": "True", "lastTransitionTime": t}]}}
        self.api.patch("Pod", meta["namespace"], meta["name"], patch, sub="status")
