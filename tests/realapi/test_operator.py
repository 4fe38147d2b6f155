"""The operator against a real Kubernetes 1.20 control plane (tests/realapi/, docs/KUBERNETES.md).

One control plane for the module: etcd, kube-apiserver (TLS, tokens, RBAC, audit log),
kube-controller-manager and kube-scheduler built from Debian's sources; the chart installed
with helm; the operator logged in as the chart's ServiceAccount; pods run by a test-side kubelet
as local processes. What kmock cannot show is shown here: server-side apply, defaulting and
pruning by the real server, the real StatefulSet, Deployment and garbage-collection controllers,
the scheduler, and RBAC (the audit log: any 403 fails the module, and the RBAC test drives each
granted verb itself). Every test stands alone: the cluster is shared, but each test creates what
it asserts on or takes it from a fixture (`tiny`), so one test runs alone and in any order.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.core.chaos import ChaosSchedule
from diloco.operator.render import naming as n
from diloco.spec import Chaos
from tests.helpers import TINY_MODEL, wait_for
from tests.kube.tools import tool
from tests.realapi.cluster import JOBS, SERVICE_ACCOUNT, Cluster, real_cluster
from tests.realapi.controlplane import ROOT

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
# A chaos seed whose schedule kills once within 5 s of the job running, then not for 500 s.
CHAOS_MEAN = 120.0
CHAOS_SEED = next(s for s in range(10_000) if (c := ChaosSchedule(Chaos(enabled=True, mean_seconds_between_kills=CHAOS_MEAN,
                                                                        seed=s))).due_at(0) <= 5.0 < 500.0 < c.due_at(1))
CLUSTER_EXAMPLES = ["k8s-cpu-kind.yaml", "k8s-gpu.yaml", "k8s-tpu.yaml", "sharded.yaml", "multicluster-home.yaml",
                    "multicluster-remote-eu.yaml", "multicluster-remote-asia.yaml"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One control plane for the module; after its last test, whatever the order, the chart's RBAC
    refused none of the operator's requests (the audit log of every test)."""
    with real_cluster(tmp_path_factory.mktemp("realapi")) as c:
        yield c
        assert not refused(c), f"the chart's RBAC refused the operator: {refused(c)}"


def audit(cluster: Cluster) -> list[dict[str, Any]]:
    """The audit log's entries of the chart's ServiceAccount (the operator's requests), so far."""
    entries = [json.loads(line) for line in Path(cluster.plane.audit_log).read_text().splitlines() if line.strip()]
    return [e for e in entries if e.get("user", {}).get("username") == SERVICE_ACCOUNT]


def refused(cluster: Cluster) -> list[tuple[str, str]]:
    return sorted({(e["verb"], e.get("requestURI")) for e in audit(cluster)
                   if e.get("responseStatus", {}).get("code") == 403})


def tiny_job(name: str, replicas: int = 2, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
            "metadata": {"name": name, "namespace": JOBS},
            "spec": {"learnerGroups": [{"name": "local", "replicas": replicas}],
                     "syncer": {"fragments": 2, "checkpointIntervalSeconds": 5},
                     "model": dict(TINY_MODEL),
                     "training": {"batchSize": 8, "warmupSteps": 10, "decaySteps": 5000, "evalIntervalSteps": 100000},
                     **spec}}


def status(cluster: Cluster, name: str, namespace: str = JOBS) -> dict[str, Any]:
    return cluster.job(name, namespace).get("status") or {}


def events(cluster: Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    """The Events `reason` about job `name` (not another test's job)."""
    return [e for e in cluster.events(JOBS, reason) if e["involvedObject"]["name"] == name]


TINY = "tiny"  # the running job the fixture keeps: the chaos test's if it ran, else a plain one
CHAOS = {"enabled": True, "meanSecondsBetweenKills": CHAOS_MEAN, "seed": CHAOS_SEED, "maxConcurrent": 1}


def gone(cluster: Cluster, name: str) -> None:
    """`name` deleted, if there, and gone (kopf's finalizer removed)."""
    cluster.kubectl("delete", "ddj", "-n", JOBS, name, "--ignore-not-found")
    wait_for(lambda: not cluster.job(name), timeout=60, what=f"job {name} gone")


def create_tiny(cluster: Cluster, **spec: Any) -> None:
    """A new job `tiny`, not one resumed from the checkpoint volume an earlier one left (retained
    on purpose: test_deleting_a_job_keeps_its_checkpoint_volume)."""
    claim = n.checkpoints(TINY)
    if cluster.admin.get("PersistentVolumeClaim", JOBS, claim) is not None:
        wait_for(lambda: not cluster.admin.list("Pod", JOBS, n.selector(TINY)), timeout=60,
                 what="the old job's pods gone")
        cluster.admin.delete("PersistentVolumeClaim", JOBS, claim)
        wait_for(lambda: cluster.admin.get("PersistentVolumeClaim", JOBS, claim) is None, timeout=60,
                 what="the old job's checkpoint volume gone")
    cluster.admin.create(tiny_job(TINY, **spec))


@pytest.fixture
def tiny(cluster: Cluster) -> str:
    """A job `tiny` of two learners, both joined: the one an earlier test left running (so the
    module starts it once), else a new one. A test may change it; what another cannot use (a
    job suspended or being deleted) is resumed or started anew here."""
    job = cluster.job(TINY)
    if job.get("metadata", {}).get("deletionTimestamp"):
        gone(cluster, TINY)
        job = {}
    if not job:
        create_tiny(cluster)
    elif job["spec"].get("suspend"):
        cluster.admin.patch("DecoupledDiLoCoJob", JOBS, TINY, {"spec": {"suspend": False}})
    wait_for(lambda: (s := status(cluster, TINY)).get("phase") == "Running" and s.get("learners") == "2/2",
             timeout=120, what="job tiny running, both learners joined")
    return TINY


def test_helm_installed_the_chart_and_the_crd_serves(cluster: Cluster) -> None:
    crd = cluster.kubectl("get", "crd", "decoupleddilocojobs.diloco.dev", "-o", "json")
    assert json.loads(crd)["status"]["acceptedNames"]["shortNames"] == ["ddj"]
    # 1.20 publishes OpenAPI v2 only (kubectl's default is v3), a few seconds after the CRD is established.
    wait_for(lambda: "learnerGroups" in cluster.kubectl("explain", "ddj.spec", "--output=plaintext-openapiv2",
                                                       check=False), timeout=30, what="kubectl explain ddj.spec")
    # The status has a schema too (diloco/spec/status.py): explained, and pruned to it by the server.
    explained = cluster.kubectl("explain", "ddj.status", "--output=plaintext-openapiv2")
    assert "learnerGroups" in explained and "startedSpec" in explained and "goodput" in explained, explained
    groups = cluster.kubectl("explain", "ddj.status.learnerGroups", "--output=plaintext-openapiv2")
    assert "readmitted" in groups and "preemption" in groups, groups


def test_every_cluster_example_applies_and_is_rendered(cluster: Cluster) -> None:
    """`kubectl apply` each example as a user would (each in a namespace of its own: the home and
    remote multi-cluster examples share a name); the operator renders each one against the real
    server (server-side apply of every child kind) or says in its status why it cannot yet."""
    applied = []
    for i, example in enumerate(CLUSTER_EXAMPLES):
        namespace = f"example-{i}"
        cluster.kubectl("create", "namespace", namespace)
        cluster.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples" / example))
        name = yaml.safe_load((ROOT / "examples" / example).read_text())["metadata"]["name"]
        applied.append((example, namespace, name))
    for example, namespace, name in applied:
        got = wait_for(lambda: status(cluster, name, namespace).get("phase"), timeout=60,
                       what=f"{example} reconciled")
        assert got != "Failed", (example, status(cluster, name, namespace))
        spec = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
        if spec.get("suspend"):  # waiting for Kueue: nothing may run before admission
            assert got == "Suspended" and not cluster.admin.list("StatefulSet", namespace), example
        elif "external" not in (spec.get("syncer") or {}):  # a learners-only cluster waits for its token
            wait_for(lambda: cluster.admin.get("ConfigMap", namespace, n.config_map(name)), timeout=30,
                     what=f"{example}: its ConfigMap")
    listing = cluster.kubectl("get", "ddj", "-A")
    assert all(name in listing for _, _, name in applied)
    for example, namespace, _ in applied:
        cluster.kubectl("delete", "-n", namespace, "-f", str(ROOT / "examples" / example))


def test_a_tiny_job_trains_a_killed_learner_is_readmitted(cluster: Cluster) -> None:
    """The operator's own chaos kills a learner pod (so the pod patch and delete go through the
    chart's RBAC); the real StatefulSet controller replaces it and the operator re-admits it.
    A new job (one the `tiny` fixture left is deleted first: the kill must be a new job's first);
    it stays for the fixture to hand on."""
    gone(cluster, TINY)
    create_tiny(cluster, chaos=CHAOS)
    running = wait_for(lambda: (s := status(cluster, "tiny")).get("phase") == "Running" and s.get("learners") == "2/2"
                       and s, timeout=120, what="both learners joined through the real control plane")
    assert running["syncer"]["ready"]
    wait_for(lambda: events(cluster, TINY, "ChaosKill"), timeout=30, what="chaos killing a learner pod")
    # Chaos is a planned restart, not a learner loss; the slot is down until the replacement joins.
    wait_for(lambda: status(cluster, "tiny")["learnerGroups"][0].get("planned", 0) >= 1, timeout=30,
             what="the restart counted")
    after = wait_for(lambda: (s := status(cluster, "tiny"))["learnerGroups"][0]["readmitted"] >= 1 and s,
                     timeout=120, what="the StatefulSet's replacement pod re-admitted")
    # kopf posts Events from a queue, a moment after the status patch: wait for them too.
    wait_for(lambda: events(cluster, TINY, "LearnerRestarted") and events(cluster, TINY, "LearnerReadmitted"),
             timeout=30, what="the LearnerRestarted and LearnerReadmitted Events")
    final = wait_for(lambda: (s := status(cluster, "tiny")).get("outerVersion", 0) > after.get("outerVersion", 0) + 3
                     and s, timeout=60, what="training after the re-admission")
    assert final["tokensMerged"] > 0
    table = cluster.kubectl("get", "ddj", "-n", JOBS, "tiny")
    assert "tiny" in table and "Running" in table


def test_hand_edits_to_children_are_put_back(cluster: Cluster, tiny: str) -> None:
    config, learners = n.config_map(tiny), n.statefulset(tiny, "local")
    original = cluster.admin.get("ConfigMap", JOBS, config)
    assert original is not None
    cluster.kubectl("patch", "configmap", "-n", JOBS, config, "--type=merge", "-p",
                    json.dumps({"data": {n.CONFIG_KEY: "edited: by hand\n"}}))
    cluster.kubectl("scale", "statefulset", "-n", JOBS, learners, "--replicas=5")
    wait_for(lambda: (cluster.admin.get("ConfigMap", JOBS, config) or {}).get("data") == original["data"],
             timeout=30, what="the ConfigMap put back")
    wait_for(lambda: (cluster.admin.get("StatefulSet", JOBS, learners) or {})["spec"]["replicas"] == 2,
             timeout=30, what="the StatefulSet's replicas put back")
    wait_for(lambda: status(cluster, tiny).get("learners") == "2/2", timeout=60, what="two learners again")


def test_an_idle_pass_writes_nothing(cluster: Cluster, tiny: str) -> None:
    """With nothing changed, the real server's defaulting and normalisation are not seen as drift:
    a few passes later, no child has a new resourceVersion."""
    def versions() -> dict[str, str]:
        out = {}
        for kind in ("ConfigMap", "Secret", "Service", "StatefulSet", "Deployment", "PersistentVolumeClaim"):
            for obj in cluster.admin.list(kind, JOBS, n.selector(tiny)):
                out[f"{kind}/{obj['metadata']['name']}"] = obj["metadata"].get("annotations", {}).get(n.APPLIED_HASH)
                out[f"{kind}/{obj['metadata']['name']}@gen"] = str(obj["metadata"].get("generation"))
        return out

    before = versions()
    assert f"StatefulSet/{n.statefulset(tiny, 'local')}" in before, before
    cluster.operator.ticks(3)
    assert versions() == before


def test_suspend_releases_every_pod_and_resume_continues(cluster: Cluster, tiny: str) -> None:
    before = status(cluster, tiny)
    cluster.admin.patch("DecoupledDiLoCoJob", JOBS, tiny, {"spec": {"suspend": True}})
    try:
        wait_for(lambda: not cluster.admin.list("Pod", JOBS, n.selector(tiny)), timeout=60,
                 what="every pod of the suspended job gone, the syncer's too")
    except AssertionError:
        left = [(p["metadata"]["name"], p["metadata"].get("deletionTimestamp"), p.get("status", {}).get("phase"))
                for p in cluster.admin.list("Pod", JOBS, n.selector(tiny))]
        raise AssertionError(f"pods left: {left}; job status {status(cluster, tiny)}") from None
    assert cluster.admin.get("PersistentVolumeClaim", JOBS, n.checkpoints(tiny)) is not None
    cluster.admin.patch("DecoupledDiLoCoJob", JOBS, tiny, {"spec": {"suspend": False}})
    resumed = wait_for(lambda: (s := status(cluster, tiny)).get("learners") == "2/2"
                       and s.get("outerVersion", 0) > before.get("outerVersion", 0) and s,
                       timeout=120, what="the job resumed from its checkpoint")
    assert resumed["phase"] == "Running"


def test_deleting_a_job_keeps_its_checkpoint_volume(cluster: Cluster, tiny: str) -> None:
    claim = cluster.admin.get("PersistentVolumeClaim", JOBS, n.checkpoints(tiny))
    assert claim is not None and not claim["metadata"].get("ownerReferences")
    cluster.kubectl("delete", "ddj", "-n", JOBS, tiny)
    wait_for(lambda: not cluster.admin.list("Pod", JOBS, n.selector(tiny)), timeout=60, what="the job's pods gone")
    wait_for(lambda: not cluster.admin.list("StatefulSet", JOBS, n.selector(tiny)), timeout=30,
             what="the StatefulSets garbage-collected")
    assert cluster.admin.get("PersistentVolumeClaim", JOBS, n.checkpoints(tiny)) is not None


def test_a_learner_that_cannot_start_ends_the_job_with_its_reason(cluster: Cluster) -> None:
    job = tiny_job("broken", replicas=1, runPolicy={"backoffLimit": 0, "ttlSecondsAfterFinished": 5})
    job["spec"]["learnerGroups"][0]["image"] = "registry.invalid/no-such-learner:0"
    cluster.kubelet.pullable = lambda image: "no-such" not in image
    cluster.admin.create(job)
    try:
        failed = wait_for(lambda: (s := status(cluster, "broken")).get("phase") == "Failed" and s, timeout=90,
                          what="the job failed for its permanent error")
    except AssertionError:
        pods = [(p["metadata"]["name"], p.get("status")) for p in cluster.admin.list("Pod", JOBS, n.selector("broken"))]
        raise AssertionError(f"status {status(cluster, 'broken')}; pods {pods}") from None
    ended = [c for c in failed["conditions"] if c.get("status") == "True" and c["type"] == "Failed"]
    assert ended and "ErrImagePull" in json.dumps(failed), failed
    wait_for(lambda: events(cluster, "broken", "ImagePullFailed"), timeout=30, what="the ImagePullFailed Event")
    # ttlSecondsAfterFinished: 5, so the operator deletes the finished job itself.
    wait_for(lambda: not cluster.job("broken"), timeout=30, what="the finished job deleted by its TTL")


# -- the admission webhook (operator/admission/webhook.py): what the operator would fail, refused at apply --


def webhook_refuses(cluster: Cluster, tmp_path: Path, manifest: dict[str, Any], namespace: str) -> str:
    """`kubectl apply` of `manifest`: refused; kubectl's stderr."""
    path = tmp_path / f"{manifest['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    done = subprocess.run([str(tool("kubectl")), f"--kubeconfig={cluster.admin_config}", "apply", "-n", namespace,
                           "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, f"applied: {done.stdout}"
    return done.stderr


def test_helm_install_set_the_webhook_up_with_the_operators_certificate(cluster: Cluster) -> None:
    """No manual step: the operator made the certificate's Secret and wrote its CA into the chart's
    ValidatingWebhookConfiguration, which asks about jobs' creates and updates and nothing else."""
    (configuration,) = [c for c in cluster.admin.request(
        "GET", "apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations")["items"]
        if c["metadata"]["name"].startswith("diloco-")]
    (hook,) = configuration["webhooks"]
    secret = cluster.admin.get("Secret", "diloco-system", "diloco-decoupled-diloco-webhook-tls")
    assert secret is not None and secret["type"] == "kubernetes.io/tls"
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert hook["clientConfig"]["service"]["name"] == "diloco-decoupled-diloco-webhook"
    assert hook["rules"][0]["resources"] == ["decoupleddilocojobs"] and hook["failurePolicy"] == "Fail"
    assert hook["timeoutSeconds"] == 5 and hook["sideEffects"] == "None"


def test_kubectl_apply_refuses_what_the_operator_would_fail_with_its_field_path(cluster: Cluster,
                                                                                 tmp_path: Path) -> None:
    """A learner template that sets the learner's image, and the TPU example with a wrong
    hostsPerLearner: refused by the webhook with the operator's own words (passes.load's),
    nothing stored; the same manifests made valid are accepted, and an edit that adds a problem
    to a stored job is refused while the stored spec stays."""
    from diloco.operator.reconcile import passes

    denied = 'admission webhook "decoupleddilocojobs.diloco.dev" denied the request: '
    image = tiny_job("templated", replicas=1)
    image["spec"]["learnerGroups"][0]["template"] = {"spec": {"containers": [{"name": "learner", "image": "mine:1"}]}}
    tpu = yaml.safe_load((ROOT / "examples" / "k8s-tpu.yaml").read_text())
    tpu["spec"]["learnerGroups"][0]["hostsPerLearner"] = 2
    for manifest in (image, tpu):
        err = webhook_refuses(cluster, tmp_path, manifest, JOBS)
        _, operator_says = passes.load({**manifest, "metadata": {**manifest["metadata"], "namespace": JOBS}})
        assert denied + "; ".join(operator_says) in err, err
        assert not cluster.job(manifest["metadata"]["name"])
    assert "spec.learnerGroups[0].template.spec.containers[0].image: the operator's learner container's; set by " \
           "spec.learnerGroups[0].image" in webhook_refuses(cluster, tmp_path, image, JOBS)
    assert "spec.learnerGroups[0].hostsPerLearner: a 4x4 TPU slice with 4 chips per pod (google.com/tpu) has 4 " \
           "host(s)" in webhook_refuses(cluster, tmp_path, tpu, JOBS)
    tpu["spec"]["learnerGroups"][0]["hostsPerLearner"] = 4
    (tmp_path / "tpu-valid.yaml").write_text(yaml.safe_dump(tpu))
    cluster.kubectl("apply", "-n", JOBS, "-f", str(tmp_path / "tpu-valid.yaml"))
    assert cluster.job("tpu-1b")["spec"]["learnerGroups"][0]["hostsPerLearner"] == 4
    tpu["spec"]["learnerGroups"][0]["hostsPerLearner"] = 2
    err = webhook_refuses(cluster, tmp_path, tpu, JOBS)
    assert denied + "spec.learnerGroups[0].hostsPerLearner" in err, err
    assert cluster.job("tpu-1b")["spec"]["learnerGroups"][0]["hostsPerLearner"] == 4
    cluster.kubectl("delete", "-n", JOBS, "ddj", "tpu-1b")
    wait_for(lambda: not cluster.job("tpu-1b"), timeout=30, what="the TPU job gone (kopf's finalizer removed)")


def test_the_cel_gate_refuses_an_immutable_edit_of_a_running_job(cluster: Cluster, tiny: str, tmp_path: Path) -> None:
    """Issue 61: the CRD's transition rules (`diloco crd` with CEL, as the chart installs it) run
    on this 1.20 server, which drops them, through the lane's CEL gate (tests/realapi/admission.py):
    `kubectl apply` of the running job with its fragment plan changed exits non-zero with the
    rule's own message, and the stored spec stays; an edit the rules allow (the learners' replicas)
    goes through the same gate."""
    from diloco.operator.crd import immutable_rules

    live = cluster.job(tiny)
    edited = {"apiVersion": live["apiVersion"], "kind": live["kind"],
              "metadata": {"name": tiny, "namespace": JOBS}, "spec": copy.deepcopy(live["spec"])}
    edited["spec"]["syncer"]["fragments"] = live["spec"]["syncer"]["fragments"] + 2
    err = webhook_refuses(cluster, tmp_path, edited, JOBS)
    (rule,) = [r for r in immutable_rules() if r["message"].startswith("spec.syncer.fragments ")]
    assert 'admission webhook "cel.tests.diloco.dev" denied the request' in err and rule["message"] in err, err
    assert cluster.job(tiny)["spec"]["syncer"]["fragments"] == live["spec"]["syncer"]["fragments"]
    seen = cluster.gate.seen
    cluster.admin.patch("DecoupledDiLoCoJob", JOBS, tiny, {"metadata": {"annotations": {"diloco.dev/probe": "1"}}})
    assert cluster.gate.seen > seen  # every write of the kind asks the gate


def granted() -> set[tuple[str, str]]:
    """(resource, verb) pairs the chart's ClusterRoles grant, with the default values: the
    operator's own and its webhook's (its configuration's caBundle)."""
    docs = yaml.safe_load_all(subprocess.run([str(tool("helm")), "template", "diloco", str(ROOT / "charts" / "decoupled-diloco")],
                                             capture_output=True, text=True, check=True).stdout)
    roles = [d for d in docs if d and d["kind"] == "ClusterRole"]
    return {(r, v) for role in roles for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}


# Granted, and needed, but never a request of its own: the API server's owner-reference
# enforcement (on here) checks it while authorising a create whose owner reference sets
# blockOwnerDeletion, so any child created without a 403 has used it.
IMPLICIT = {("decoupleddilocojobs/finalizers", "update")}


def rbac_scenario(cluster: Cluster) -> None:
    """What uses each granted verb, whatever else ran: a job whose chaos kills a learner pod (the
    pod's patch and delete), then suspended (its syncer's Deployment deleted) and deleted, and one
    that fails on its image, has its learners' children pruned and is deleted by its TTL (the
    job's delete)."""
    cluster.kubelet.pullable = lambda image: "no-such" not in image
    broken = tiny_job("audit-fails", runPolicy={"backoffLimit": 0, "ttlSecondsAfterFinished": 5})
    broken["spec"]["learnerGroups"][0]["image"] = "registry.invalid/no-such-learner:0"
    cluster.admin.create(broken)
    cluster.admin.create(tiny_job("audit-chaos", chaos=CHAOS))
    wait_for(lambda: events(cluster, "audit-chaos", "ChaosKill"), timeout=180, what="chaos killing a learner pod of job audit-chaos")
    wait_for(lambda: not cluster.job("audit-fails"), timeout=90, what="the failed job deleted by its TTL")
    cluster.admin.patch("DecoupledDiLoCoJob", JOBS, "audit-chaos", {"spec": {"suspend": True}})
    wait_for(lambda: not cluster.admin.list("Deployment", JOBS, n.selector("audit-chaos")), timeout=60,
             what="the suspended job's syncer Deployment deleted")
    gone(cluster, "audit-chaos")


def test_rbac_every_granted_verb_used_and_none_refused(cluster: Cluster) -> None:
    """The audit log, after a scenario of its own (so it holds run alone or first) and whatever
    ran before it: no request of the chart's ServiceAccount was refused (the module's fixture
    checks the same after the last test), and every verb the ClusterRole grants was used (a
    server-side apply that created an object is a create)."""
    rbac_scenario(cluster)
    ours = audit(cluster)
    assert ours, "the operator made no requests as the chart's ServiceAccount"
    assert not refused(cluster), f"the chart's RBAC refused the operator: {refused(cluster)}"
    used = set()
    for e in ours:
        ref = e.get("objectRef") or {}
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((resource, e["verb"]))
        if e["verb"] == "patch" and e.get("responseStatus", {}).get("code") == 201:
            used.add((resource, "create"))  # a server-side apply that created: authorised as both
    unused = granted() - used - IMPLICIT
    assert not unused, f"granted but never used by the operator in this lane: {sorted(unused)}"
    assert granted() >= IMPLICIT
