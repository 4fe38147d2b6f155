"""The Kueue integration without a cluster: the Workload a queued job gets, and how its admission reads."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator import kueue, render
from diloco.operator import naming as n
from diloco.operator.children import KUEUE_KINDS, MANAGED_KINDS, PRUNABLE
from diloco.operator.context import Config
from diloco.spec import DecoupledDiLoCoJob, parse_job

OWNER = render.Owner("demo", "research", "uid-1")
TPU = {"name": "tpu", "replicas": 3, "hostsPerLearner": 4,
       "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                        "cloud.google.com/gke-tpu-topology": "4x4"},
       "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
       "resources": {"requests": {"google.com/tpu": 4, "cpu": "8"}, "limits": {"google.com/tpu": 4}}}
GPU = {"name": "gpu", "replicas": 2, "resources": {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}}


def job(groups: list[dict[str, Any]] | None = None, **spec: Any) -> DecoupledDiLoCoJob:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                      "metadata": {"name": "demo"},
                      "spec": {"learnerGroups": groups or [TPU, GPU], "syncer": {"fragments": 4, "quorum": 1},
                               **spec}})


def wl(*conditions: tuple[str, str], **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "w"},
            "status": {"conditions": [{"type": t, "status": s, "reason": t, "message": f"{t} message"}
                                      for t, s in conditions], **status}}


def test_one_pod_set_per_group_plus_the_syncer_counting_every_host() -> None:
    got = kueue.workload(job(syncer={"fragments": 4, "quorum": 1, "shards": 2}), OWNER, "training")
    assert got["apiVersion"] == "kueue.x-k8s.io/v1beta1" and got["kind"] == "Workload"
    assert got["spec"]["queueName"] == "training"
    sets = {p["name"]: p for p in got["spec"]["podSets"]}
    assert [p["name"] for p in got["spec"]["podSets"]] == ["tpu", "gpu", "syncer"]
    assert sets["tpu"]["count"] == 12  # 3 learners x 4 hosts
    assert sets["gpu"]["count"] == 2
    assert sets["syncer"]["count"] == 2  # one pod per shard
    assert "priorityClassName" not in got["spec"]  # the job spec has none to give


def test_templates_carry_resources_node_selector_and_tolerations() -> None:
    sets = {p["name"]: p for p in kueue.workload(job(), OWNER, "q")["spec"]["podSets"]}
    tpu = sets["tpu"]["template"]["spec"]
    assert tpu["containers"][0]["resources"] == {"requests": {"google.com/tpu": "4", "cpu": "8"},
                                                 "limits": {"google.com/tpu": "4"}}
    assert tpu["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
    assert tpu["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert sets["gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    syncer = sets["syncer"]["template"]
    assert syncer["spec"] == render.syncer_workload(job(), OWNER)["spec"]["template"]["spec"]
    # Kueue allows only labels and annotations in a PodSet template's metadata.
    for p in sets.values():
        assert set(p["template"]["metadata"]) <= {"labels", "annotations"}


def test_workload_named_and_owned_like_a_child() -> None:
    got = kueue.workload(job(), OWNER, "q")
    meta = got["metadata"]
    assert meta["name"] == kueue.workload_name("demo", "uid-1") and meta["name"].startswith("diloco-demo-")
    assert meta["namespace"] == "research" and meta["labels"][n.JOB] == "demo"
    assert meta["ownerReferences"] == [n.owner_reference("demo", "uid-1")]
    assert meta["ownerReferences"][0]["controller"] is True
    assert len(kueue.workload_name("j" * 50, "u")) <= 63
    assert kueue.workload_name("demo", "uid-1") != kueue.workload_name("demo", "uid-2")


def test_a_learners_only_cluster_queues_no_syncer() -> None:
    remote = job([{**TPU, "shardOffset": 0}, {**GPU, "shardOffset": 3}], syncer={"external": {"endpoint": "syncer.example.com:443", "tokenSecret": "home-token"},
                         "fragments": 4, "quorum": 1}, data={"shards": 16})
    assert [p["name"] for p in kueue.pod_sets(remote, OWNER)] == ["tpu", "gpu"]


def test_replicas_change_the_workload() -> None:
    bigger = job([TPU, {**GPU, "replicas": 5}])
    assert kueue.workload(bigger, OWNER, "q") != kueue.workload(job(), OWNER, "q")
    assert {p["name"]: p["count"] for p in kueue.pod_sets(bigger, OWNER)}["gpu"] == 5


def test_a_training_setting_leaves_the_workload_as_it_is() -> None:
    """Only what Kueue reads is in it: an admitted job's lr or quorum change must not re-queue it."""
    changed = job(training={"learningRate": 0.001}, syncer={"fragments": 4, "quorum": 2})
    assert kueue.workload(changed, OWNER, "q") == kueue.workload(job(), OWNER, "q")
    assert render.syncer_config_hash(changed) != render.syncer_config_hash(job())


def test_too_many_groups_refused_with_the_field() -> None:
    seven = [{"name": f"g{i}", "replicas": 1} for i in range(7)]
    assert kueue.problems(job(seven)) == []
    (problem,) = kueue.problems(job([*seven, {"name": "g7", "replicas": 1}]))
    assert problem.startswith("spec.learnerGroups:") and "at most 8 PodSets" in problem and "at most 7" in problem
    (shadow,) = kueue.problems(job([{"name": "syncer", "replicas": 1}]))
    assert shadow.startswith("spec.learnerGroups[0].name:")


@pytest.mark.parametrize(("conditions", "admitted", "evicted"), [
    ((), False, False),
    ((("QuotaReserved", "True"),), False, False),  # quota, but an admission check still pending
    ((("QuotaReserved", "True"), ("Admitted", "True")), True, False),
    ((("QuotaReserved", "True"), ("Admitted", "True"), ("Evicted", "True")), True, True),
    ((("QuotaReserved", "False"), ("Admitted", "False"), ("Evicted", "True")), False, True),
    ((("QuotaReserved", "True"), ("Admitted", "True"), ("Evicted", "False")), True, False),  # re-admitted
])
def test_admitted_and_evicted_read_the_conditions(conditions: tuple[tuple[str, str], ...], admitted: bool,
                                                   evicted: bool) -> None:
    assert kueue.admitted(wl(*conditions)) is admitted
    assert kueue.evicted(wl(*conditions)) is evicted
    assert not kueue.admitted(None) and not kueue.evicted(None) and not kueue.admitted({})


def test_gate_runs_only_while_admitted_and_not_evicted() -> None:
    waiting = kueue.gate(None, "diloco-demo-1", "training")
    assert waiting.suspend and not waiting.admitted and waiting.reason == "WaitingForAdmission"
    assert "diloco-demo-1" in waiting.message and "training" in waiting.message
    admitted = wl(("QuotaReserved", "True"), ("Admitted", "True"), admission={"clusterQueue": "cq"})
    ok = kueue.gate(admitted, "w", "training")
    assert not ok.suspend and ok.admitted and ok.reason == "Admitted" and "cq" in ok.message
    out = kueue.gate(wl(("Admitted", "True"), ("Evicted", "True")), "w", "training")
    assert out.suspend and out.reason == "Evicted" and "Evicted message" in out.message
    deleting = {**admitted, "metadata": {"name": "w", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert kueue.gate(deleting, "w", "training").suspend  # being replaced: admits nothing


def test_stale_only_when_held_and_changed() -> None:
    desired = kueue.workload(job(), OWNER, "q")
    held = {**desired, "status": wl(("QuotaReserved", "True"))["status"]}
    assert not kueue.stale(None, desired) and not kueue.stale(held, desired)
    grown = kueue.workload(job([TPU, {**GPU, "replicas": 3}]), OWNER, "q")
    assert kueue.stale(held, grown)
    assert kueue.stale(held, kueue.workload(job(), OWNER, "other-queue"))
    assert not kueue.stale({**desired, "status": {}}, grown)  # not held: updated in place


def test_job_condition_set_and_dropped() -> None:
    conds = kueue.condition([], kueue.gate(None, "w", "q"), "2026-01-01T00:00:00Z", 3)
    (got,) = conds
    assert (got["type"], got["status"], got["reason"]) == ("Admitted", "False", "WaitingForAdmission")
    assert kueue.condition(conds, None, "2026-01-01T00:00:01Z", 3) == []


def test_no_queue_without_the_label_or_without_kueue_support() -> None:
    labels = {kueue.QUEUE_LABEL: "training"}
    assert kueue.queue(True, labels) == "training"
    assert kueue.queue(False, labels) is None
    assert kueue.queue(True, {}) is None and kueue.queue(True, None) is None
    assert "Workload" not in Config().managed_kinds and "Workload" in Config(kueue=True).managed_kinds
    assert set(KUEUE_KINDS) <= PRUNABLE and not set(KUEUE_KINDS) & set(MANAGED_KINDS)


def test_config_reads_kueue_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Config.from_env().kueue
    monkeypatch.setenv("DILOCO_KUEUE", "true")
    assert Config.from_env().kueue


class Recorder:
    def __init__(self, status: int | None = None):
        self.calls: list[tuple[Any, ...]] = []
        self.status = status

    def patch(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from diloco.operator.kube import ApiError

        self.calls.append((args, kwargs))
        if self.status:
            raise ApiError(self.status, "conflict")
        return {}


def test_finish_keeps_kueues_conditions_and_guards_the_version() -> None:
    live = {**wl(("QuotaReserved", "True"), ("Admitted", "True")),
            "metadata": {"name": "w", "namespace": "ns", "resourceVersion": "7", "generation": 1}}
    kube = Recorder()
    kueue.finish(kube, live, True, "the job finished", "2026-01-01T00:00:00Z")  # type: ignore[arg-type]
    ((args, kwargs),) = kube.calls
    assert args[:3] == ("Workload", "ns", "w") and kwargs == {"sub": "status"}
    body = args[3]
    assert body["metadata"] == {"resourceVersion": "7"}
    assert [(x["type"], x["status"]) for x in body["status"]["conditions"]] == \
        [("QuotaReserved", "True"), ("Admitted", "True"), ("Finished", "True")]
    done = {**live, "status": {"conditions": body["status"]["conditions"]}}
    kueue.finish(kube, done, True, "again", "2026-01-01T00:00:01Z")  # type: ignore[arg-type]
    assert len(kube.calls) == 1  # already Finished: nothing written
    kueue.finish(Recorder(409), live, False, "x", "t")  # type: ignore[arg-type]  # the next pass retries


def test_chart_kueue_enabled_reaches_the_operator_with_rbac_for_workloads(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Any) -> None:
    """kueue.enabled: DILOCO_KUEUE for Config.kueue, and the Workload rules; off by default."""
    from tests.test_chart import rendered

    values = tmp_path / "kueue.yaml"
    values.write_text("kueue: {enabled: true}\n")
    for path, on in ((None, False), (values, True)):
        docs = rendered(path)
        (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
        for item in deploy["spec"]["template"]["spec"]["containers"][0]["env"]:
            monkeypatch.setenv(item["name"], item["value"])
        assert Config.from_env().kueue is on
        (role,) = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
        rules = {(r, v) for rule in role["rules"] if "kueue.x-k8s.io" in rule["apiGroups"]
                 for r in rule["resources"] for v in rule["verbs"]}
        assert rules == ({("workloads", v) for v in ("list", "create", "patch", "delete")}
                         | {("workloads/status", "patch")} if on else set())


@pytest.mark.parametrize("example", ["k8s-gpu.yaml", "k8s-tpu.yaml"])
def test_the_queued_examples_fit_one_workload(example: str) -> None:
    from pathlib import Path

    import yaml

    manifest = yaml.safe_load((Path(__file__).parents[1] / "examples" / example).read_text())
    assert manifest["metadata"]["labels"][kueue.QUEUE_LABEL] and manifest["spec"]["suspend"] is True
    parsed = parse_job({**manifest, "metadata": {"name": manifest["metadata"]["name"]}})
    assert kueue.problems(parsed) == []
    sets = kueue.pod_sets(parsed, render.Owner(parsed.metadata.name, "research", "u"))
    want = [(g.name, g.replicas * g.hosts_per_learner) for g in parsed.spec.learner_groups] + [("syncer", 1)]
    assert [(p["name"], p["count"]) for p in sets] == want
