"""The operator end to end against an emulated API server (kmock), with kopf in a thread.

The tests act like users (kubectl apply/patch/delete through the API) and like the cluster
(tests/kube/controllers.py plays the StatefulSet/Deployment controllers, the garbage
collector and the kubelet); assertions read the API like `kubectl get` would.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.contract import Finished
from diloco.operator.admission import immutable
from diloco.operator.context import Config
from diloco.operator.kube import KINDS, Kube
from diloco.operator.reconcile.children import MANAGED_KINDS, stamped
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.spec import parse_job
from tests.helpers import wait_for
from tests.kube import NAMESPACE
from tests.kube.controllers import Controllers, set_ready
from tests.kube.emulator import ClusterThread
from tests.kube.processes import free_port
from tests.kube.running import OperatorThread

pytestmark = pytest.mark.slow  # the kopf operator on an emulated API server: seconds a test (make test only)


pytest_plugins = ["tests.kube.fixtures"]
FAST = Config(status_interval=0.5, chaos_interval=0.25, stuck_timeout=1.0)
JOB = "DecoupledDiLoCoJob"
CHILD_PLURALS = {KINDS[k][1] for k in (*MANAGED_KINDS, "Pod")}


def manifest(name: str = "demo", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": JOB, "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"learnerGroups": [{"name": "us", "region": "us-central1", "replicas": 2},
                                       {"name": "eu", "region": "europe-west4", "replicas": 1}], **spec}}


def children_of(kube: Kube, job: str = "demo") -> dict[tuple[str, str], dict[str, Any]]:
    return {(k, o["metadata"]["name"]): o for k in MANAGED_KINDS for o in kube.list(k, NAMESPACE, {n.JOB: job})}


def status(kube: Kube, job: str = "demo") -> dict[str, Any]:
    return (kube.get(JOB, NAMESPACE, job) or {}).get("status") or {}


def condition(kube: Kube, type_: str, job: str = "demo") -> dict[str, Any]:
    return next((c for c in status(kube, job).get("conditions") or [] if c["type"] == type_), {})


def events(kube: Kube, reason: str) -> list[dict[str, Any]]:
    items = kube.request("GET", f"api/v1/namespaces/{NAMESPACE}/events").get("items") or []
    return [e for e in items if e.get("reason") == reason]


def learner_pods(kube: Kube, group: str | None = None) -> list[dict[str, Any]]:
    return kube.list("Pod", NAMESPACE, n.selector("demo", n.LEARNER, group))


@pytest.fixture
def operator(cluster: ClusterThread) -> Iterator[OperatorThread]:
    with OperatorThread(FAST) as op:
        yield op


def test_create_gives_exactly_the_expected_children(api: Kube, controllers: Controllers,
                                                    operator: OperatorThread) -> None:
    created = api.create(manifest())
    wait_for(lambda: status(api).get("phase") == "Running", what="phase Running")
    live = children_of(api)
    assert set(live) == {
        ("ConfigMap", "demo-config"), ("Secret", "demo-token"), ("PersistentVolumeClaim", "demo-checkpoints"),
        ("Deployment", "demo-syncer"), ("Service", "demo-syncer"),
        ("StatefulSet", "demo-us"), ("Service", "demo-us"), ("StatefulSet", "demo-eu"), ("Service", "demo-eu"),
        ("NetworkPolicy", "demo-syncer"), ("PodDisruptionBudget", "demo-syncer")}
    # Each child is exactly what the pure renderer says, owned by the job (the checkpoint: retained).
    token = base64.b64decode(live[("Secret", "demo-token")]["data"]["token"]).decode()
    assert len(token) >= 32
    owner = render.Owner("demo", NAMESPACE, created["metadata"]["uid"])
    for want in map(stamped, render.children(immutable.pinned(parse_job(manifest())), owner, token, started=True,
                                                  finished=False)):
        got = live[(want["kind"], want["metadata"]["name"])]
        assert {k: got[k] for k in want if k != "metadata"} == {k: v for k, v in want.items() if k != "metadata"}
        owners = [] if want["kind"] == "PersistentVolumeClaim" else [n.owner_reference("demo", owner.uid)]
        assert got["metadata"].get("ownerReferences", []) == owners
        assert got["metadata"]["labels"][n.JOB] == "demo"
    # Running needs the syncer; the learners' ready count follows within a status tick or two.
    s = wait_for(lambda: (x := status(api)).get("learners") == "3/3" and x, what="3/3 learners ready")
    assert s["observedGeneration"] == 1
    assert s["syncer"]["endpoint"] == "demo-syncer.research.svc:50051"
    assert condition(api, "Created")["status"] == "True" and condition(api, "Degraded")["status"] == "False"
    assert events(api, "ChildrenUpdated")


def test_rerun_and_operator_restart_change_nothing(cluster: ClusterThread, api: Kube,
                                                   controllers: Controllers) -> None:
    with OperatorThread(FAST) as op:
        api.create(manifest())
        wait_for(lambda: status(api).get("phase") == "Running", what="phase Running")
        op.ticks(2)
        before = {k: o["metadata"]["resourceVersion"] for k, o in children_of(api).items()}
        writes = len(cluster.writes(n.MANAGER, CHILD_PLURALS))
        op.ticks(2)  # every tick is a full reconcile: a re-run
        assert len(cluster.writes(n.MANAGER, CHILD_PLURALS)) == writes
    with OperatorThread(FAST) as op:  # a new operator process: resume handlers, fresh memory
        op.ticks(3)
    assert len(cluster.writes(n.MANAGER, CHILD_PLURALS)) == writes
    assert {k: o["metadata"]["resourceVersion"] for k, o in children_of(api).items()} == before
    assert api.get(JOB, NAMESPACE, "demo")["metadata"]["generation"] == 1


def test_scaling_adding_and_removing_groups(api: Kube, controllers: Controllers,
                                            operator: OperatorThread) -> None:
    api.create(manifest(data={"shards": 6}))  # room for 6 learners: tests/operator/admission/test_immutable.py
    wait_for(lambda: status(api).get("learners") == "3/3", what="3 learners")
    eu_pods = {p["metadata"]["uid"] for p in learner_pods(api, "eu")}
    syncer_pods = {p["metadata"]["uid"] for p in api.list("Pod", NAMESPACE, n.selector("demo", n.SYNCER))}
    spec = manifest()["spec"]
    spec["learnerGroups"][0]["replicas"] = 4  # scale us up
    spec["learnerGroups"].append({"name": "scavenged", "region": "asia-east1", "replicas": 1})  # mid-run join
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"learnerGroups": spec["learnerGroups"]}})
    wait_for(lambda: status(api).get("learners") == "6/6", what="6 learners")
    assert api.get("StatefulSet", NAMESPACE, "demo-us")["spec"]["replicas"] == 4
    assert ("StatefulSet", "demo-scavenged") in children_of(api)
    assert status(api)["observedGeneration"] == 2
    # Nobody else was restarted: the other groups and the syncer keep training.
    assert {p["metadata"]["uid"] for p in learner_pods(api, "eu")} == eu_pods
    assert {p["metadata"]["uid"] for p in api.list("Pod", NAMESPACE, n.selector("demo", n.SYNCER))} == syncer_pods
    # Removing a group deletes its StatefulSet and Service; scaling down is not a loss.
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"learnerGroups": spec["learnerGroups"][:2]}})
    wait_for(lambda: status(api).get("learners") == "5/5" and ("StatefulSet", "demo-scavenged") not in children_of(api),
             what="group removed")
    assert ("Service", "demo-scavenged") not in children_of(api)
    assert all(g["lost"] == 0 for g in status(api)["learnerGroups"])


def test_suspend_releases_every_pod_keeps_the_state_and_resume_restores(api: Kube, controllers: Controllers,
                                                                        operator: OperatorThread) -> None:
    api.create(manifest())
    wait_for(lambda: status(api).get("phase") == "Running", what="Running")
    token = api.get("Secret", NAMESPACE, "demo-token")["data"]
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"suspend": True}})
    wait_for(lambda: status(api).get("phase") == "Suspended" and not api.list("Pod", NAMESPACE, n.selector("demo")),
             what="suspended, every pod gone")
    assert set(children_of(api)) == {("ConfigMap", "demo-config"), ("Secret", "demo-token"),
                                     ("PersistentVolumeClaim", "demo-checkpoints"), ("Service", "demo-syncer"),
                                     ("NetworkPolicy", "demo-syncer")}
    assert condition(api, "Suspended")["status"] == "True"
    assert all(g["lost"] == 0 for g in status(api)["learnerGroups"])  # removed on purpose
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"suspend": False}})
    wait_for(lambda: status(api).get("learners") == "3/3" and status(api).get("phase") == "Running", what="resumed")
    assert api.get("Secret", NAMESPACE, "demo-token")["data"] == token  # learners and syncer still agree
    assert condition(api, "Suspended")["status"] == "False"


def test_created_suspended_creates_nothing(api: Kube, operator: OperatorThread) -> None:
    api.create(manifest(suspend=True))
    wait_for(lambda: status(api).get("phase") == "Suspended", what="Suspended")
    operator.ticks(2)
    assert children_of(api) == {}


def test_delete_cleans_up(cluster: ClusterThread, api: Kube, controllers: Controllers,
                          operator: OperatorThread) -> None:
    api.create(manifest())
    wait_for(lambda: status(api).get("phase") == "Running", what="Running")
    api.delete(JOB, NAMESPACE, "demo")
    # Owner references let the garbage collector remove everything, pods included, but for the
    # trained model: the checkpoint claim has none (checkpointRetention: Retain, the default).
    model = {("PersistentVolumeClaim", "demo-checkpoints")}
    wait_for(lambda: set(children_of(api)) == model and not api.list("Pod", NAMESPACE), what="children collected")
    writes = len(cluster.writes(n.MANAGER, CHILD_PLURALS))
    api.create(manifest("witness", suspend=True))  # its reconciles show the timers keep running
    operator.ticks(3)
    assert set(children_of(api)) == model and len(cluster.writes(n.MANAGER, CHILD_PLURALS)) == writes


def test_invalid_spec_names_the_field_and_creates_nothing(api: Kube, operator: OperatorThread) -> None:
    name = "long-job-name"
    bad = manifest(name, syncer={"quorum": 9})
    bad["spec"]["learnerGroups"].append({"name": "x" * 40})  # with the job's name: too long a StatefulSet name
    api.create(bad)
    wait_for(lambda: condition(api, "Failed", name).get("reason") == "InvalidSpec", what="InvalidSpec")
    failed = condition(api, "Failed", name)
    assert failed["status"] == "True" and status(api, name)["phase"] == "Failed"
    assert "spec.syncer.quorum: 9 exceeds the 4 learners" in failed["message"]
    wait_for(lambda: events(api, "InvalidSpec"), what="an InvalidSpec Event")
    posted = len(events(api, "InvalidSpec"))
    operator.ticks(3, "invalid")
    assert children_of(api, name) == {} and len(events(api, "InvalidSpec")) == posted  # posted once
    api.patch(JOB, NAMESPACE, name, {"spec": {"syncer": {"quorum": 1}}})
    wait_for(lambda: "spec.learnerGroups[2].name" in condition(api, "Failed", name).get("message", ""),
             what="the name problem")
    assert children_of(api, name) == {}
    api.patch(JOB, NAMESPACE, name, {"spec": {"learnerGroups": bad["spec"]["learnerGroups"][:2]}})
    wait_for(lambda: condition(api, "Failed", name).get("status") == "False" and children_of(api, name),
             what="fixed")


def test_lost_learner_counted_force_deleted_and_readmitted(api: Kube, controllers: Controllers,
                                                           operator: OperatorThread) -> None:
    controllers.runtime.auto_ready = False  # the test says when a pod is ready
    api.create(manifest())
    wait_for(lambda: len([p for p in learner_pods(api) if (p.get("status") or {}).get("phase")]) == 3, what="pods")
    wait_for(lambda: api.list("Pod", NAMESPACE, n.selector("demo", n.SYNCER)), what="syncer pod")
    for pod in api.list("Pod", NAMESPACE, n.selector("demo")):
        set_ready(api, pod)
    wait_for(lambda: status(api).get("learners") == "3/3", what="3 ready")
    controllers.finalize_deletions = False  # its node is gone: the pod stays Terminating
    victim = api.get("Pod", NAMESPACE, "demo-us-1")
    api.delete("Pod", NAMESPACE, "demo-us-1", grace_seconds=1)
    wait_for(lambda: status(api)["learnerGroups"][0]["lost"] == 1, what="loss counted")
    assert [x["slot"] for x in status(api)["lostLearners"]] == ["us-1"]
    wait_for(lambda: condition(api, "Degraded").get("status") == "True", what="Degraded")
    assert status(api)["phase"] == "Running"  # the others keep training
    wait_for(lambda: events(api, "PodForceDeleted"), what="force delete after the grace period + timeout")
    controllers.finalize_deletions = True
    replacement = wait_for(lambda: next((p for p in learner_pods(api, "us") if p["metadata"]["name"] == "demo-us-1"
                                         and p["metadata"]["uid"] != victim["metadata"]["uid"]
                                         and (p.get("status") or {}).get("phase")), None), what="replacement")
    operator.ticks(2)
    assert status(api)["learnerGroups"][0]["readmitted"] == 0  # not ready yet: not back
    set_ready(api, replacement)
    wait_for(lambda: status(api)["learnerGroups"][0]["readmitted"] == 1, what="re-admission counted")
    wait_for(lambda: status(api)["learners"] == "3/3", what="3 ready again")
    s = status(api)
    assert (s["lostLearners"], s["learnerGroups"][0]["lost"]) == ([], 1)
    wait_for(lambda: events(api, "LearnerLost") and events(api, "LearnerReadmitted"), what="the loss and re-admission Events")
    wait_for(lambda: condition(api, "Degraded").get("status") == "False", what="not Degraded")
    # A preemption is counted apart from losses.
    api.patch("Pod", NAMESPACE, "demo-eu-0", {"status": {"conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"},
        {"type": "Ready", "status": "True"}]}}, sub="status")
    api.delete("Pod", NAMESPACE, "demo-eu-0", grace_seconds=1)
    wait_for(lambda: status(api)["learnerGroups"][1]["preempted"] == 1, what="preemption counted")
    assert status(api)["learnerGroups"][1]["lost"] == 0
    wait_for(lambda: events(api, "LearnerPreempted"), what="the LearnerPreempted Event")


def test_chaos_kills_learners_within_max_concurrent(api: Kube, controllers: Controllers,
                                                    operator: OperatorThread) -> None:
    api.create(manifest(chaos={"enabled": True, "meanSecondsBetweenKills": 0.5, "seed": 7, "maxConcurrent": 1}))
    most_down = 0

    def three_kills() -> bool:
        nonlocal most_down
        s = status(api)
        most_down = max(most_down, len(s.get("lostLearners") or []))
        return (s.get("chaos") or {}).get("kills", 0) >= 3

    wait_for(three_kills, timeout=20, period=0.05, what="3 chaos kills")
    assert most_down == 1  # each kill waited until the previous victim was re-admitted
    kills = wait_for(lambda: len(e := events(api, "ChaosKill")) >= 3 and e, what="3 ChaosKill Events")
    assert all("deleted pod demo-" in e["message"] for e in kills)
    # planned: chaos kills are not learner losses
    restarted = wait_for(lambda: events(api, "LearnerRestarted"), what="a LearnerRestarted Event")
    assert restarted and all("by chaos" in e["message"] for e in restarted) and not events(api, "LearnerLost")
    wait_for(lambda: sum(g.get("planned", 0) for g in status(api)["learnerGroups"]) >= 3,
             what="each kill counted as a planned restart")
    assert all(g["lost"] == 0 for g in status(api)["learnerGroups"])
    wait_for(lambda: sum(g["readmitted"] for g in status(api)["learnerGroups"]) >= 2, what="re-admissions")
    assert not any("syncer" in e["message"] for e in kills)  # the syncer is not a target by default


def test_deadline_fails_the_job_and_ttl_deletes_it(api: Kube, controllers: Controllers,
                                                   operator: OperatorThread) -> None:
    api.create(manifest(runPolicy={"activeDeadlineSeconds": 1, "ttlSecondsAfterFinished": 2}))
    wait_for(lambda: condition(api, "Failed").get("reason") == "DeadlineExceeded", what="DeadlineExceeded")
    assert status(api)["phase"] == "Failed" and status(api).get("completionTime")
    # cleanPodPolicy Running: the learners go, a failed job's syncer stays for its logs.
    wait_for(lambda: set(children_of(api)) == {("ConfigMap", "demo-config"), ("Secret", "demo-token"),
                                               ("PersistentVolumeClaim", "demo-checkpoints"),
                                               ("NetworkPolicy", "demo-syncer"), ("Deployment", "demo-syncer"),
                                               ("Service", "demo-syncer")}, what="learners gone")
    wait_for(lambda: api.get(JOB, NAMESPACE, "demo") is None, what="TTL deletion")
    # The job's children go with it, but for the trained model (checkpointRetention: Retain).
    wait_for(lambda: set(children_of(api)) == {("PersistentVolumeClaim", "demo-checkpoints")}, what="only the model")


def test_operator_process_serves_liveness_and_metrics(api: Kube, tmp_path: Path) -> None:
    """`diloco operator` as the chart runs it: reconciles, answers /healthz, exports metrics."""
    metrics, health = free_port(), free_port()
    env = {**os.environ, "DILOCO_OPERATOR_METRICS_PORT": str(metrics), "DILOCO_OPERATOR_HEALTH_PORT": str(health),
           "DILOCO_STATUS_INTERVAL_SECONDS": "0.5"}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "diloco.apps.cli", "operator", "--standalone"], env=env,
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        api.create(manifest())
        wait_for(lambda: status(api).get("phase") == "Pending" and children_of(api), timeout=30, what="children")

        def get(port: int, path: str) -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
                    return str(response.read().decode())
            except OSError:
                return ""

        assert wait_for(lambda: get(health, "/healthz"), what="liveness endpoint")
        assert 'diloco_operator_reconciles_total{outcome="ok"}' in get(metrics, "/metrics")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read().decode()[-2000:] if proc.stderr else ""


def crash(api: Kube, name: str, restarts: int, code: int, finished: int | None = None) -> None:
    """What the kubelet reports after a learner container exited with `code` (and restarts);
    `finished`: the learner's termination message said it reached that many steps."""
    pod = api.get("Pod", NAMESPACE, name)
    container = pod["spec"]["containers"][0]["name"]
    ended: dict[str, Any] = {"exitCode": code, "reason": "Error", "containerID": f"containerd://{restarts}"}
    if finished is not None:
        found = n.learner_of(pod)
        assert found is not None, name
        ended["message"] = Finished(str(found[1]), finished, finished).line()
    api.patch("Pod", NAMESPACE, name, {"status": {"containerStatuses": [{
        "name": container, "ready": False, "restartCount": restarts, "image": "learner:1",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": {"terminated": ended}}],
        "conditions": [{"type": "Ready", "status": "False"}]}}, sub="status")


def test_permanent_learner_failures_end_the_job_after_backoff_limit(api: Kube, controllers: Controllers,
                                                                    operator: OperatorThread) -> None:
    api.create(manifest(runPolicy={"backoffLimit": 1}))
    wait_for(lambda: status(api).get("learners") == "3/3", what="3 learners")
    crash(api, "demo-us-0", 1, 2)  # Exit.CONFIG: a restart cannot help
    wait_for(lambda: (status(api).get("failures") or {}).get("permanent") == 1, what="one permanent failure")
    operator.ticks(2)  # seen again on every pass: still counted once
    assert status(api)["failures"]["permanent"] == 1 and status(api)["phase"] == "Running"
    failing = condition(api, "PodsFailing")
    assert failing["reason"] == "ConfigError" and "pod demo-us-0" in failing["message"]
    [event] = wait_for(lambda: events(api, "ConfigError"), what="the ConfigError Event")
    assert "pod demo-us-0 (learner us-0)" in event["message"] and "fix:" in event["message"]
    crash(api, "demo-us-0", 2, 2)  # its next run fails the same way: 2 > backoffLimit=1
    wait_for(lambda: condition(api, "Failed").get("reason") == "BackoffLimitExceeded", what="BackoffLimitExceeded")
    assert status(api)["phase"] == "Failed" and "ConfigError" in condition(api, "Failed")["message"]
    wait_for(lambda: not [k for k in children_of(api) if k[0] == "StatefulSet"], what="learners gone")


def test_learners_that_finish_their_steps_are_no_loss_and_end_the_job_succeeded(api: Kube, controllers: Controllers,
                                                                               operator: OperatorThread) -> None:
    """A learner exits 0 at spec.training.steps, saying so in its termination message, and the
    kubelet restarts it (the StatefulSet's restartPolicy): no loss, no LearnerLost; once all three
    have, Succeeded and no learners."""
    api.create(manifest(training={"steps": 100}))
    wait_for(lambda: status(api).get("learners") == "3/3", what="3 learners")
    controllers.runtime.auto_ready = False  # a finished learner's restarts keep its pod unready
    crash(api, "demo-us-0", 1, 0, finished=100)  # finished (its termination message says so), restarted in place
    wait_for(lambda: "finished spec.training.steps=100: us-0" in condition(api, "Degraded").get("message", ""),
             what="Degraded naming the finished learner")
    operator.ticks(2)
    s = status(api)
    assert s["phase"] == "Running" and s["lostLearners"] == [] and s["learnerGroups"][0]["lost"] == 0
    crash(api, "demo-us-1", 1, 0, finished=100)
    crash(api, "demo-eu-0", 2, 0, finished=100)
    done = wait_for(lambda: (x := condition(api, "Succeeded")).get("status") == "True" and x, what="Succeeded")
    assert done["reason"] == "StepsReached" and done["message"] == \
        "all 3 learners reached spec.training.steps=100 and exited 0"
    wait_for(lambda: not [k for k in children_of(api) if k[0] == "StatefulSet"], what="learners gone")
    assert not events(api, "LearnerLost") and sum(g["lost"] for g in status(api)["learnerGroups"]) == 0


def test_an_edit_of_the_model_on_a_running_job_is_refused_and_changes_nothing(
        api: Kube, controllers: Controllers, operator: OperatorThread) -> None:
    api.create(manifest())
    wait_for(lambda: status(api).get("learners") == "3/3" and status(api).get("startedSpec"), what="started")
    operator.ticks(2)

    def shape() -> dict[tuple[str, str], Any]:
        return {k: (o["metadata"].get("generation"), o.get("data"), o.get("spec")) for k, o in children_of(api).items()}

    before = shape()
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"model": {"dModel": 256}, "syncer": {"fragments": 8}}})
    wait_for(lambda: condition(api, "SpecRejected").get("reason") == "SpecImmutable", what="SpecImmutable")
    message = condition(api, "SpecRejected")["message"]
    assert "spec.model.dModel is 256, started with 128" in message and "spec.syncer.fragments" in message
    operator.ticks(3)
    assert shape() == before and status(api)["phase"] == "Running"  # every child exactly as it was
    assert len(events(api, "SpecImmutable")) == 1 and status(api)["observedGeneration"] == 2
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"model": None, "syncer": None}})  # reverted
    wait_for(lambda: condition(api, "SpecRejected").get("status") == "False", what="refusal cleared")
    operator.ticks(2)
    assert shape() == before


def test_managed_by_changed_away_on_a_running_job_is_refused_and_still_handled(
        api: Kube, controllers: Controllers, operator: OperatorThread) -> None:
    api.create(manifest())
    wait_for(lambda: status(api).get("learners") == "3/3" and status(api).get("startedSpec"), what="started")
    generations = {k: o["metadata"].get("generation") for k, o in children_of(api).items()}
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"managedBy": "kueue.x-k8s.io/multikueue"}})
    wait_for(lambda: "spec.managedBy" in condition(api, "SpecRejected").get("message", ""), what="managedBy refused")
    operator.ticks(2)  # the timers keep running: the job is still this operator's
    assert {k: o["metadata"].get("generation") for k, o in children_of(api).items()} == generations
    assert status(api)["phase"] == "Running"
