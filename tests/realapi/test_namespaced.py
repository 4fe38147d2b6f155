"""Namespaced RBAC and spec.training.steps as an ending, against the real control plane (tests/realapi/).

A cluster of its own: the chart installed with `watchNamespaces: [jobs, second]` (a Role and
RoleBinding in each, no ClusterRole but the admission webhook's) and the operator logged in as
its ServiceAccount, watching those two namespaces; a third one holds a job it must leave alone. A steps-bounded job trains a
real learner process to its last step under those Roles alone: the learner exits 0, the real
StatefulSet's pod would restart it, and the operator ends the job Succeeded/StepsReached and
removes its learners. The audit log: no request refused, none outside the two namespaces (the
audit test, after a scenario of its own, and the module's fixture after the last test). Each test
stands alone, so any one runs alone and in any order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from diloco.operator.render import naming as n
from diloco.operator.status import steps
from tests.helpers import wait_for
from tests.realapi.cluster import JOBS, RELEASE, SERVICE_ACCOUNT, SYSTEM, Cluster, real_cluster
from tests.realapi.test_operator import audit, refused, tiny_job

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
SECOND, THIRD = "second", "third"
WATCHED = (JOBS, SECOND)
ROLE = f"{RELEASE}-decoupled-diloco"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One control plane for the module; after its last test, whatever the order, the audit log
    holds no refused request and none outside the watched namespaces."""
    with real_cluster(tmp_path_factory.mktemp("realapi-namespaced"), watch=WATCHED, namespaces=(THIRD,)) as c:
        yield c
        assert not refused(c), f"the namespaced Roles refused the operator: {refused(c)}"
        assert not outside(audit(c)), f"requests outside {WATCHED}: {outside(audit(c))}"


def webhooks(ref: dict[str, Any]) -> bool:
    """Besides: the admission webhook's certificate, made by the operator (operator/admission/certificates.py):
    its Secret in the release's namespace (a create names no object), its CA in the chart's
    webhook configuration, both by name."""
    return (ref.get("resource"), ref.get("namespace"), ref.get("name")) in {
        ("secrets", SYSTEM, f"{ROLE}-webhook-tls"), ("secrets", SYSTEM, None),
        ("validatingwebhookconfigurations", None, ROLE)}


def outside(ours: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(verb, URI) of the operator's requests outside the watched namespaces but the webhook's."""
    return sorted({(e["verb"], e.get("requestURI")) for e in ours
                   if (ref := e.get("objectRef")) and ref.get("namespace") not in WATCHED and not webhooks(ref)})


def status(cluster: Cluster, name: str, namespace: str = JOBS) -> dict[str, Any]:
    return cluster.job(name, namespace).get("status") or {}


def events(cluster: Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    """The Events `reason` about job `name` (not another test's job)."""
    return [e for e in cluster.events(JOBS, reason) if e["involvedObject"]["name"] == name]


def condition(cluster: Cluster, name: str, type_: str) -> dict[str, Any]:
    return next((x for x in status(cluster, name).get("conditions") or [] if x["type"] == type_), {})


def test_the_operator_holds_a_role_in_each_watched_namespace_and_nothing_cluster_wide(cluster: Cluster) -> None:
    rbac = "apis/rbac.authorization.k8s.io/v1"
    for namespace in WATCHED:
        roles = cluster.admin.request("GET", f"{rbac}/namespaces/{namespace}/roles").get("items") or []
        assert ROLE in [r["metadata"]["name"] for r in roles], namespace
    assert not cluster.admin.request("GET", f"{rbac}/namespaces/{THIRD}/roles").get("items")
    bindings = cluster.admin.request("GET", f"{rbac}/clusterrolebindings").get("items") or []
    account = SERVICE_ACCOUNT.rsplit(":", 1)[-1]
    # Cluster-wide only the admission webhook's: its own configuration's caBundle, by name.
    assert [b["metadata"]["name"] for b in bindings if any(
        s.get("kind") == "ServiceAccount" and s.get("name") == account for s in b.get("subjects") or [])] == \
        [f"{ROLE}-webhook"]
    webhook = cluster.admin.request("GET", f"{rbac}/clusterroles/{ROLE}-webhook")
    assert webhook["rules"] == [{"apiGroups": ["admissionregistration.k8s.io"], "resources":
                                 ["validatingwebhookconfigurations"], "resourceNames": [ROLE], "verbs": ["get", "patch"]}]


def test_a_job_whose_learners_finish_their_steps_ends_succeeded(cluster: Cluster) -> None:
    job = tiny_job("steps", replicas=1)
    job["spec"]["training"]["steps"] = 40
    cluster.admin.create(job)
    learner = f"{n.statefulset('steps', 'local')}-0"
    exits: list[dict[str, Any]] = []

    def succeeded() -> dict[str, Any] | bool:
        # The learner's own word, read while its pod lives: the ending's cleanup deletes the pod.
        for log in cluster.runtime.logs_of(learner):
            exits.extend(e for x in log.splitlines() if '"event": "exit"' in x and (e := json.loads(x)) not in exits)
        x = condition(cluster, "steps", "Succeeded")
        return x.get("status") == "True" and x

    try:
        done = wait_for(succeeded, timeout=200, what="the job Succeeded once its learner reached spec.training.steps")
    except AssertionError:
        pods = [(p["metadata"]["name"], (p.get("status") or {}).get("containerStatuses"))
                for p in cluster.admin.list("Pod", JOBS, n.selector("steps"))]
        raise AssertionError(f"status {status(cluster, 'steps')}; pods {pods}") from None
    assert done["reason"] == steps.REASON
    assert done["message"] == "all 1 learners reached spec.training.steps=40 and exited 0"
    final = status(cluster, "steps")
    assert final["phase"] == "Succeeded" and final["completionTime"] and final["desiredLearners"] == 0
    assert final["outerVersion"] > 0 and final["tokensMerged"] > 0  # it trained, through the syncer
    phase = cluster.operator.ctx.metrics.registry.get_sample_value
    wait_for(lambda: phase("diloco_job_phase", {"diloco_namespace": JOBS, "diloco_job": "steps",
                                                "phase": "Succeeded"}) == 1, timeout=10, what="the phase metric")
    # The learner really finished: a process of it flushed and said so before exiting 0.
    assert [e for e in exits if e["reason"] == "finished" and e["slot"] >= 40 and e["flushed"]], exits
    # cleanPodPolicy Running (the default): the learner StatefulSet and the syncer go, so nothing
    # restarts the learner again; the checkpoint volume stays.
    wait_for(lambda: not cluster.admin.list("StatefulSet", JOBS, n.selector("steps")), timeout=30,
             what="the learner StatefulSet removed")
    wait_for(lambda: not cluster.admin.list("Pod", JOBS, n.selector("steps")), timeout=60, what="the job's pods gone")
    assert cluster.admin.get("PersistentVolumeClaim", JOBS, n.checkpoints("steps")) is not None
    [event] = wait_for(lambda: events(cluster, "steps", steps.REASON), timeout=30, what="the StepsReached Event")
    assert event["type"] == "Normal"
    # Exiting 0 was no loss: nothing counted it, no Event said so.
    assert not (final.get("lostLearners") or []) and final["learnerGroups"][0]["lost"] == 0
    assert not events(cluster, "steps", "LearnerLost")
    cluster.kubectl("delete", "ddj", "-n", JOBS, "steps")


def test_learners_killed_by_a_liveness_probe_train_on_to_their_steps(cluster: Cluster) -> None:
    """Issue 50: each learner of a steps-bounded job is SIGTERMed once mid-training, as the kubelet
    does on a failed liveness probe, and restarted. It exits 0 then too, but its termination message
    stays empty: the job trains on and ends Succeeded/StepsReached only once both reached the steps
    and said so in their termination messages."""
    total = 60
    job = tiny_job("probed", replicas=2)
    job["spec"]["training"]["steps"] = total
    job["spec"]["learnerGroups"][0]["slowdown"] = 8.0  # steps of ~0.1 s or more: a kill lands mid-training
    cluster.admin.create(job)
    names = [f"{n.statefulset('probed', 'local')}-{i}" for i in range(2)]
    exits: dict[str, list[dict[str, Any]]] = {name: [] for name in names}

    def read_exits() -> None:
        for name in names:
            for log in cluster.runtime.logs_of(name):
                exits[name].extend(e for x in log.splitlines() if '"event": "exit"' in x
                                   and (e := json.loads(x)) not in exits[name])

    def slot(name: str) -> int:
        """The slot the pod's running learner last reported (-1 before it trains)."""
        found = [json.loads(x)["slot"] for log in cluster.runtime.logs_of(name)[-1:] for x in log.splitlines()
                 if '"event": "progress"' in x]
        return found[-1] if found else -1

    def learner_status(name: str) -> dict[str, Any]:
        pod = cluster.admin.get("Pod", JOBS, name) or {}
        return next((c for c in (pod.get("status") or {}).get("containerStatuses") or [] if c["name"] == n.LEARNER),
                    {})

    wait_for(lambda: all(5 <= slot(name) < total // 2 for name in names) or
             any(slot(name) >= total // 2 for name in names), timeout=150, what="both learners training")
    assert all(slot(name) < total // 2 for name in names), [slot(name) for name in names]  # mid-training
    for name in names:
        cluster.kubelet.fail_liveness(JOBS, name)

    def killed() -> list[dict[str, Any]] | bool:
        read_exits()
        ended = condition(cluster, "probed", "Succeeded")
        assert ended.get("status") != "True", f"the job ended on the kills' exit 0: {ended}"
        got = [learner_status(name) for name in names]
        return all(c.get("restartCount", 0) >= 1 and c.get("lastState", {}).get("terminated") for c in got) and got

    statuses = wait_for(killed, timeout=60, what="both learners killed, their exits reported")
    for c in statuses:  # SIGTERM's exit is 0 as well; only its termination message tells it apart
        assert c["lastState"]["terminated"]["exitCode"] == 0 and not c["lastState"]["terminated"].get("message"), c
    cluster.operator.ticks(2)  # the old rule (exit 0 in lastState) would have ended the job here
    now = status(cluster, "probed")
    # Not ended: Running, or Pending while both restart (no learner ready).
    assert now.get("phase") in ("Running", "Pending") and condition(cluster, "probed", "Succeeded").get(
        "status") != "True", now

    def succeeded() -> dict[str, Any] | bool:
        read_exits()
        x = condition(cluster, "probed", "Succeeded")
        return x.get("status") == "True" and x

    try:
        done = wait_for(succeeded, timeout=200, what="Succeeded once both learners reached spec.training.steps")
    except AssertionError:
        raise AssertionError(f"status {status(cluster, 'probed')}; learners {[learner_status(x) for x in names]}; "
                             f"exits {exits}") from None
    assert (done["reason"], done["message"]) == (
        steps.REASON, f"all 2 learners reached spec.training.steps={total} and exited 0")
    for name in names:  # each trained on to the steps after its kill, and said so
        assert [e for e in exits[name] if e["reason"] == "finished" and e["slot"] >= total], exits[name]
    final = status(cluster, "probed")
    assert final["phase"] == "Succeeded" and final["desiredLearners"] == 0
    cluster.kubectl("delete", "ddj", "-n", JOBS, "probed")


def test_jobs_in_a_namespace_it_does_not_watch_are_left_alone(cluster: Cluster) -> None:
    for namespace in (SECOND, THIRD):
        job = tiny_job("elsewhere", replicas=1)
        job["metadata"]["namespace"] = namespace
        cluster.admin.create(job)
    wait_for(lambda: status(cluster, "elsewhere", SECOND).get("phase"), timeout=60, what="the job in 'second' reconciled")
    assert cluster.admin.get("ConfigMap", SECOND, n.config_map("elsewhere")) is not None
    cluster.operator.ticks(3)
    ignored = cluster.job("elsewhere", THIRD)
    assert not ignored.get("status") and not ignored["metadata"].get("finalizers"), ignored
    assert cluster.admin.get("ConfigMap", THIRD, n.config_map("elsewhere")) is None
    for namespace in (SECOND, THIRD):
        cluster.kubectl("delete", "ddj", "-n", namespace, "elsewhere")


def test_no_request_was_refused_or_outside_the_watched_namespaces(cluster: Cluster) -> None:
    """Every request of the chart's ServiceAccount in this module's audit log was authorised by
    the two Roles, and none named another namespace or a cluster-wide resource: after a scenario
    of its own (so it holds run alone or first), besides whatever ran before it: a job in each
    watched namespace rendered and deleted, one in the third left alone. Its learners ask for a
    node pool no node is in, so no process starts."""
    names = {namespace: f"audited-{namespace}" for namespace in (*WATCHED, THIRD)}
    for namespace, name in names.items():
        job = tiny_job(name, replicas=1)
        job["metadata"]["namespace"] = namespace
        job["spec"]["learnerGroups"][0]["nodeSelector"] = {"diloco.dev/test-pool": "none"}
        cluster.admin.create(job)
    for namespace in WATCHED:
        wait_for(lambda: cluster.admin.get("ConfigMap", namespace, n.config_map(names[namespace])), timeout=60,
                 what=f"the job in {namespace} rendered")
    cluster.operator.ticks(2)
    for namespace, name in names.items():
        cluster.kubectl("delete", "ddj", "-n", namespace, name)
    ours = audit(cluster)
    assert len(ours) > 50, "the operator made (almost) no requests as the chart's ServiceAccount"
    assert not refused(cluster), f"the namespaced Roles refused the operator: {refused(cluster)}"
    assert not outside(ours), f"requests outside {WATCHED}: {outside(ours)}"
    assert {(e["objectRef"]["resource"], e["verb"]) for e in ours if (e.get("objectRef") or {}).get("namespace") == SYSTEM
            } == {("secrets", "get"), ("secrets", "create")}  # what the webhook's Role there grants
