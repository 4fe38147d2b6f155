"""The whole product as a user runs it, on a real node (docs/DEVELOPMENT.md, "A real node").

The control plane of tests/realapi, plus a real kubelet and kube-proxy built from the same
Kubernetes 1.20 tree, Debian's containerd 1.6 and runc, and the images `make test-images` builds,
imported into containerd (tests/cluster/node.py, scripts/node.sh). Then, as a user would:
`helm install` the chart, so the operator runs as the chart's Deployment from the syncer image
with its own ServiceAccount; `kubectl apply` examples/k8s-cpu-kind.yaml, sized down for two
shared cores; the syncer and learner pods start in real containers and train; one learner pod is
deleted and the job re-admits its replacement; the job reaches Succeeded; and `diloco export`
reads the trained model from the checkpoint volume (a local PersistentVolume on the node).

Root, minutes, and the first run builds the kubelet (about 10 minutes) and the images: run with
`make test-cluster`, or set DILOCO_TEST_CLUSTER=1. DILOCO_IMAGES_REUSE=1 runs the images already
built, as they are.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.operator.kube import Kube
from tests.helpers import TINY_MODEL, wait_for
from tests.kube.tools import tool
from tests.realapi.cluster import JOBS, RELEASE, SYSTEM
from tests.realapi.controlplane import ROOT

pytestmark = [
    pytest.mark.cluster, pytest.mark.e2e,
    pytest.mark.timeout(3600),  # a first run builds the kubelet and the images
    pytest.mark.skipif(os.environ.get("DILOCO_TEST_CLUSTER") != "1",
                       reason="a real kubelet and containerd (minutes, root): `make test-cluster` or DILOCO_TEST_CLUSTER=1"),
]

LEARNER_IMAGE = os.environ.get("DILOCO_LEARNER_IMAGE", "localhost/diloco/learner:dev")
SYNCER_IMAGE = os.environ.get("DILOCO_SYNCER_IMAGE", "localhost/diloco/syncer:dev")
EXAMPLE = ROOT / "examples" / "k8s-cpu-kind.yaml"
# Two learners of the tiny model; one learner step of the whole job is 2 x 8 x 64 tokens.
# 4M tokens: about two minutes of training here, so the deleted learner is back well before the end.
TOKEN_BUDGET = int(os.environ.get("DILOCO_CLUSTER_TOKEN_BUDGET", 4_000_000))
CACHE = "jax-cache"  # the compilation cache's claim: the learners share it and it outlives their pods


def log(message: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Lane:
    admin: Kube
    admin_config: Path
    folder: Path
    node: Any

    def kubectl(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([str(tool("kubectl")), f"--kubeconfig={self.admin_config}", *args],
                              capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done.stdout

    @property
    def node_name(self) -> str:
        return str(self.node.name)

    def helm(self, *args: str) -> str:
        done = subprocess.run([str(tool("helm")), f"--kubeconfig={self.admin_config}", *args],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: {done.stderr}")
        return done.stdout

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        return self.admin.request("GET", f"api/v1/namespaces/{namespace}/pods").get("items") or []

    def events(self, namespace: str, reason: str) -> list[dict[str, Any]]:
        items = self.admin.request("GET", f"api/v1/namespaces/{namespace}/events").get("items") or []
        return [e for e in items if e.get("reason") == reason]

    def status(self, name: str) -> dict[str, Any]:
        return (self.admin.get("DecoupledDiLoCoJob", JOBS, name) or {}).get("status") or {}

    def describe(self) -> str:
        """Pods, their states and recent events: what a failure message needs."""
        out = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False)]
        for ns in (SYSTEM, JOBS):
            for pod in self.pods(ns):
                for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                    out.append(f"{pod['metadata']['name']}: {json.dumps(cs.get('state'))} "
                               f"last={json.dumps(cs.get('lastState'))}")
        out.append(self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False)[-4000:])
        return "\n".join(out)


def sized_down(name: str) -> dict[str, Any]:
    """examples/k8s-cpu-kind.yaml for one node of two shared cores: two learners of the tiny model
    whose requests fit beside the syncer and the operator, our images, frequent checkpoints, a
    small token budget, and chaos off (the test deletes a learner itself)."""
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"].update(name=name, namespace=JOBS)
    spec = job["spec"]
    (group,) = spec["learnerGroups"]
    group.update(replicas=2, image=LEARNER_IMAGE,
                 resources={"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}})
    spec["syncer"].update(image=SYNCER_IMAGE, checkpointIntervalSeconds=5,
                          resources={"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}})
    spec["model"] = dict(TINY_MODEL)
    # A compilation cache shared by the learners and kept across pod replacements (a claim the
    # test binds to a local volume), so the deleted learner's replacement compiles nothing.
    spec["training"].update(tokenBudget=TOKEN_BUDGET, warmupSteps=20, compilationCache={"persistentVolumeClaim": CACHE})
    spec["chaos"] = {"enabled": False}
    return job


@pytest.fixture(scope="module")
def lane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lane]:
    if os.geteuid() != 0:
        pytest.fail("make test-cluster needs root: containerd, runc, iptables and the kubelet's mounts")
    from tests.cluster.node import Node, NodeControlPlane

    t0 = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "node.sh"), "prepare"], capture_output=True, text=True,
                          timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log(f"prepared (tools, kubelet, images) in {time.monotonic() - t0:.0f} s")
    folder = tmp_path_factory.mktemp("cluster")
    with NodeControlPlane(folder / "control-plane") as plane:
        admin = Kube(plane.url, token=plane.admin_token, ca_file=str(plane.ca_file), user_agent="diloco-tests")
        admin_config = plane.kubeconfig(folder / "admin.kubeconfig", plane.admin_token)
        with Node(plane, folder / "node", admin) as node:
            t1 = time.monotonic()
            node.wait_ready()
            log(f"control plane and node ready in {time.monotonic() - t0:.0f} s (node {time.monotonic() - t1:.0f} s)")
            lane = Lane(admin, admin_config, folder, node)
            try:
                yield lane
            finally:
                # The node is drained through the kubelet before it stops: the job first, so its
                # controllers stop replacing pods, then the chart, then whatever pod is left.
                lane.kubectl("delete", "ddj", "--all", "-n", JOBS, "--wait=false", check=False)
                try:
                    lane.helm("uninstall", RELEASE, "--namespace", SYSTEM)
                except AssertionError:
                    pass  # not installed
                for kind in ("statefulsets", "deployments"):
                    lane.kubectl("delete", kind, "--all", "-n", JOBS, "--wait=false", check=False)
                node.drain()
                dead = plane.alive() + node.alive()
                assert not dead, f"components exited during the test: {dead}"


def test_the_chart_and_a_job_on_a_real_node(lane: Lane) -> None:
    t0 = time.monotonic()
    name = "kind-demo"
    # The checkpoint volume: a local PersistentVolume on the node, bound by the real PV controller
    # to the claim the operator creates (no provisioner here); the kubelet applies fsGroup to it.
    # The compilation cache: another, bound to the claim the job names (users create theirs).
    volume, cache = (lane.node.volumes / f"{kind}-{secrets.token_hex(3)}" for kind in ("checkpoints", "cache"))
    for folder, capacity in ((volume, "10Gi"), (cache, "1Gi")):
        folder.mkdir(parents=True)
        lane.admin.request("POST", "api/v1/persistentvolumes", {
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": folder.name},
            "spec": {"capacity": {"storage": capacity}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "local": {"path": str(folder)},
                     "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                         {"key": "kubernetes.io/hostname", "operator": "In", "values": [lane.node_name]}]}]}}}})

    # The chart, as a user installs it, from our syncer image.
    repository, tag = SYNCER_IMAGE.rsplit(":", 1)
    values = lane.folder / "values.yaml"
    values.write_text(yaml.safe_dump({"image": {"repository": repository, "tag": tag},
                                      "operator": {"statusIntervalSeconds": 2}}))
    lane.helm("install", RELEASE, str(ROOT / "charts" / "decoupled-diloco"), "--namespace", SYSTEM,
              "--create-namespace", "-f", str(values))

    def operator_ready() -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for p in lane.pods(SYSTEM) for c in (p.get("status") or {}).get("conditions") or [])

    try:
        wait_for(operator_ready, timeout=240, period=1, what="the chart's operator pod ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{lane.describe()}") from None
    log(f"operator running from {SYNCER_IMAGE} after {time.monotonic() - t0:.0f} s")

    # The example, sized down, applied as a user would.
    lane.kubectl("create", "namespace", JOBS)
    lane.admin.request("POST", f"api/v1/namespaces/{JOBS}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CACHE},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": cache.name,
                 "resources": {"requests": {"storage": "1Gi"}}}})
    manifest = lane.folder / "k8s-cpu-kind.yaml"
    manifest.write_text(yaml.safe_dump(sized_down(name)))
    lane.kubectl("apply", "-f", str(manifest))

    def joined() -> dict[str, Any] | None:
        s = lane.status(name)
        ok = s.get("phase") == "Running" and s.get("learners") == "2/2" and (s.get("tokensMerged") or 0) > 0
        return s if ok else None

    try:
        running = wait_for(joined, timeout=300, period=1, what="both learners training through the syncer")
    except AssertionError as e:
        raise AssertionError(f"{e}\nstatus: {json.dumps(lane.status(name))}\n{lane.describe()}") from None
    assert running["syncer"]["ready"]
    log(f"both learners training after {time.monotonic() - t0:.0f} s: {running.get('tokensMerged')} tokens merged")

    # Every container ran from our images, as uid 10001, under the kubelet.
    pods = lane.pods(JOBS)
    images = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert images == {LEARNER_IMAGE, SYNCER_IMAGE}, images
    assert all(p["spec"]["nodeName"] == lane.node_name for p in pods)
    uids = lane.node.container_uids()
    assert uids and set(uids.values()) == {"10001"}, uids

    # A learner pod deleted by hand: the StatefulSet replaces it, the operator re-admits it.
    victim = f"{name}-local-0"
    old_uid = next(p["metadata"]["uid"] for p in pods if p["metadata"]["name"] == victim)
    killed = time.time()
    lane.kubectl("delete", "pod", "-n", JOBS, victim, "--wait=false")
    readmitted = wait_for(lambda: (s := lane.status(name))["learnerGroups"][0].get("readmitted", 0) >= 1 and s,
                          timeout=240, period=1, what="the replacement learner re-admitted")
    replacement = next(p for p in lane.pods(JOBS) if p["metadata"]["name"] == victim)
    assert replacement["metadata"]["uid"] != old_uid
    wait_for(lambda: lane.events(JOBS, "LearnerReadmitted"), timeout=30, what="the LearnerReadmitted Event")
    log(f"{victim} replaced and re-admitted after {time.monotonic() - t0:.0f} s "
        f"({readmitted.get('tokensMerged')} tokens merged)")

    # The replacement read what its predecessor compiled (the shared cache): its joined line
    # counts JAX's cache hits and no compile, and its training line times the start.
    def started() -> tuple[dict[str, Any], dict[str, Any]] | None:
        lines = [json.loads(ln) for ln in lane.kubectl("logs", "-n", JOBS, victim, check=False).splitlines()
                 if ln.startswith("{")]
        found = {e.get("event"): e for e in lines if isinstance(e, dict)}
        return (found["joined"], found["training"]) if "joined" in found and "training" in found else None

    joined_line, training = wait_for(started, timeout=120, period=1, what="the replacement's training line")
    hits = joined_line["compile_cache"]
    assert hits["hits"] > 0 and hits["misses"] == 0, joined_line
    log(f"{victim}'s replacement: compilation cache {hits}; kill -> first accepted push "
        f"{training['t'] - killed:.1f} s (process start -> joined {training['joined']:.1f} s, -> first accepted push "
        f"{training['first_push_accepted']:.1f} s)")

    # The learner that kept running: its held-out losses, read from its log while it runs (the pod
    # goes when the job finishes). At the budget the learner exits 0 and the kubelet restarts its
    # container, whose log has no evals yet: the longest list read is the one kept.
    survivor = f"{name}-local-1"
    evals: list[float] = []

    def finished() -> dict[str, Any] | None:
        text = lane.kubectl("logs", "-n", JOBS, survivor, check=False)
        lines = (json.loads(ln) for ln in text.splitlines() if ln.startswith("{"))
        read = [e["eval_loss"] for e in lines if isinstance(e, dict) and e.get("event") == "eval"]
        if len(read) >= len(evals):
            evals[:] = read
        s = lane.status(name)
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    try:
        done = wait_for(finished, timeout=900, period=2, what=f"the job's {TOKEN_BUDGET} tokens")
    except AssertionError as e:
        raise AssertionError(f"{e}\nstatus: {json.dumps(lane.status(name))}\n{lane.describe()}") from None
    assert done["phase"] == "Succeeded", done
    assert done["tokensMerged"] >= TOKEN_BUDGET
    log(f"Succeeded after {time.monotonic() - t0:.0f} s: {done['tokensMerged']} tokens, "
        f"outer version {done.get('outerVersion')}")

    # It learned: random weights score about ln(256) = 5.5 nats/byte; this model ends near 1.6-1.8.
    assert len(evals) >= 2 and evals[-1] < min(evals[0], 2.5), evals
    log(f"{survivor}: held-out loss {evals[0]:.2f} -> {evals[-1]:.2f} nats/byte over {len(evals)} evals")

    # The trained model, read from the checkpoint volume on the node by `diloco export`.
    out = lane.folder / "export"
    exported = subprocess.run([str(Path(sys.executable).parent / "diloco"), "export", "--config", str(manifest),
                               str(volume), str(out)], capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "config.json").exists()
    owners = {f.stat().st_uid for f in volume.rglob("*") if f.is_file()}
    assert owners == {10001}, owners  # written by the syncer's container, as the pod's user
    log(f"exported {out / 'model.safetensors'}; lane took {time.monotonic() - t0:.0f} s after the node was ready")
    shutil.rmtree(volume)
    shutil.rmtree(cache)
