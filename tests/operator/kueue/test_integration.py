"""The Kueue integration without a cluster: the Workload a queued job gets, and how its admission reads."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from diloco.operator.context import Config
from diloco.operator.kueue import api as kueue_api
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import placement, priorities, topology
from diloco.operator.reconcile.children import KUEUE_KINDS, MANAGED_KINDS, PRUNABLE
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.spec import DecoupledDiLoCoJob, parse_job

pytest_plugins = ["tests.kube.fixtures"]
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
    assert got["apiVersion"] == "kueue.x-k8s.io/v1beta2" and got["kind"] == "Workload"  # the newest by default
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


def test_kueues_reserved_pods_resource_is_refused_with_the_field() -> None:
    """Kueue's webhook refuses a Workload whose containers ask for `pods` (validateResourceList);
    `diloco validate` and the webhook refuse the job first, naming where it is asked for."""
    asks = {**GPU, "resources": {"requests": {"pods": 1}}, "template": {"spec": {"containers": [
        {"name": "sidecar", "image": "busybox", "resources": {"limits": {"pods": "1"}}}]}}}
    got = kueue.problems(job([asks], syncer={"fragments": 4, "resources": {"requests": {"pods": 2}}}))
    assert [p.split(":")[0] for p in got] == ["spec.learnerGroups[0].resources.requests[pods]",
                                             "spec.learnerGroups[0].template.spec.containers[0].resources.limits[pods]",
                                             "spec.syncer.resources.requests[pods]"]
    assert all("Kueue reserves the resource name 'pods'" in p for p in got)
    # Two groups with minReplicas are fine: one minCount, the other starts at its least (integration.first).
    assert kueue.problems(job([{**GPU, "minReplicas": 1}, {**GPU, "name": "gpu2", "minReplicas": 1}])) == []


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
    out = kueue.gate(wl(("QuotaReserved", "True"), ("Admitted", "True"), ("Evicted", "True")), "w", "training")
    assert out.suspend and out.reason == "Evicted" and "Evicted message" in out.message
    released = wl(("QuotaReserved", "False"), ("Admitted", "False"), ("Evicted", "True"))
    again = kueue.gate(released, "w", "training")
    assert again.suspend and again.reason == "Requeued" and "checkpoint" in again.message
    inactive = kueue.gate({**released, "spec": {"active": False}}, "w", "training")
    assert inactive.suspend and inactive.reason == "Deactivated" and "spec.active" in inactive.message
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
    kueue_api.finish(kube, live, succeeded=True, message="the job finished",  # type: ignore[arg-type]
                 now="2026-01-01T00:00:00Z")
    ((args, kwargs),) = kube.calls
    assert args[:3] == ("Workload", "ns", "w") and kwargs == {"sub": "status"}
    body = args[3]
    assert body["metadata"] == {"resourceVersion": "7"}
    assert [(x["type"], x["status"]) for x in body["status"]["conditions"]] == \
        [("QuotaReserved", "True"), ("Admitted", "True"), ("Finished", "True")]
    done = {**live, "status": {"conditions": body["status"]["conditions"]}}
    kueue_api.finish(kube, done, succeeded=True, message="again", now="2026-01-01T00:00:01Z")  # type: ignore[arg-type]
    assert len(kube.calls) == 1  # already Finished: nothing written
    # the next pass retries
    kueue_api.finish(Recorder(409), live, succeeded=False, message="x", now="t")  # type: ignore[arg-type]


@pytest.mark.slow
def test_chart_kueue_enabled_reaches_the_operator_with_rbac_for_workloads(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Any) -> None:
    """kueue.enabled: DILOCO_KUEUE for Config.kueue, and the Workload rules; off by default."""
    from tests.charts.test_chart import rendered

    values = tmp_path / "kueue.yaml"
    values.write_text("kueue: {enabled: true}\n")
    for path, on in ((None, False), (values, True)):
        docs = rendered(path)
        (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
        for item in deploy["spec"]["template"]["spec"]["containers"][0]["env"]:
            if "value" in item:  # not POD_NAME's downward-API reference
                monkeypatch.setenv(item["name"], item["value"])
        assert Config.from_env().kueue is on
        (role,) = [d for d in docs if d["kind"] in ("Role", "ClusterRole") and not d["metadata"]["name"].endswith(
            ("-kueue", "-webhook"))]  # Kueue's cluster-scoped reader (tests/charts/test_chart.py); the webhook's own
        rules = {(r, v) for rule in role["rules"] if "kueue.x-k8s.io" in rule["apiGroups"]
                 for r in rule["resources"] for v in rule["verbs"]}
        assert rules == ({("workloads", v) for v in ("list", "watch", "create", "patch", "delete")}
                         | {("workloads/status", "patch")} if on else set())


@pytest.mark.parametrize("example", ["k8s-gpu.yaml", "k8s-tpu.yaml"])
def test_the_queued_examples_fit_one_workload(example: str) -> None:
    from pathlib import Path

    import yaml

    manifest = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / example).read_text())
    assert manifest["metadata"]["labels"][kueue.QUEUE_LABEL] and manifest["spec"]["suspend"] is True
    parsed = parse_job({**manifest, "metadata": {"name": manifest["metadata"]["name"]}})
    assert kueue.problems(parsed) == []
    sets = kueue.pod_sets(parsed, render.Owner(parsed.metadata.name, "research", "u"))
    want = [(g.name, g.replicas * g.hosts_per_learner) for g in parsed.spec.learner_groups] + [("syncer", 1)]
    assert [(p["name"], p["count"]) for p in sets] == want


# -- Kueue of today: the served version, priority, topology, the admitted flavors ---------------

H100 = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "h100"},
        "spec": {"nodeLabels": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "pool": "h100"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}
SPOT = {"metadata": {"name": "spot"}, "spec": {"nodeLabels": {"cloud.google.com/gke-spot": "true"},
                                                "tolerations": [{"key": "cloud.google.com/gke-spot",
                                                                 "operator": "Equal", "value": "true",
                                                                 "effect": "NoSchedule"}]}}


@pytest.mark.parametrize(("version", "want"), [
    ("v1beta1", {"priorityClassName": "high", "priorityClassSource": "kueue.x-k8s.io/workloadpriorityclass",
                 "priority": 1000}),
    ("v1beta2", {"priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"},
                 "priority": 1000}),
])
def test_the_workload_speaks_the_served_version_and_carries_the_priority(version: str, want: dict[str, Any]) -> None:
    got = kueue.workload(job(), OWNER, "q", version=version, priority=priorities.Priority("WorkloadPriorityClass", "high",
                                                                                      1000))
    assert got["apiVersion"] == f"kueue.x-k8s.io/{version}"
    assert {k: v for k, v in got["spec"].items() if k not in ("queueName", "podSets")} == want
    pod_class = priorities.priority_fields(priorities.Priority("PriorityClass", "batch", 5), version)
    assert pod_class == ({"priorityClassName": "batch", "priorityClassSource": "scheduling.k8s.io/priorityclass",
                          "priority": 5} if version == "v1beta1" else
                         {"priorityClassRef": {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "batch"},
                          "priority": 5})


def test_the_priority_class_is_the_label_else_the_first_pod_priority_class() -> None:
    labelled = parse_job({**job().model_dump(by_alias=True, exclude_none=True),
                          "metadata": {"name": "demo", "labels": {priorities.PRIORITY_LABEL: "high"}}})
    assert priorities.priority_class(labelled) == ("WorkloadPriorityClass", "high")
    assert priorities.priority_class(job()) is None
    pod = job([TPU, {**GPU, "pod": {"priorityClassName": "from-pod"}}])
    assert priorities.priority_class(pod) == ("PriorityClass", "from-pod")
    templated = job([{**TPU, "template": {"spec": {"priorityClassName": "from-template"}}}, GPU])
    assert priorities.priority_class(templated) == ("PriorityClass", "from-template")


def test_a_new_priority_value_keeps_the_held_workload_a_new_class_replaces_it() -> None:
    high = kueue.workload(job(), OWNER, "q", priority=priorities.Priority("WorkloadPriorityClass", "high", 1000))
    held = {**high, "status": wl(("QuotaReserved", "True"))["status"]}
    assert not kueue.stale(held, kueue.workload(job(), OWNER, "q", priority=priorities.Priority(
        "WorkloadPriorityClass", "high", 2000)))  # the value changes in place (Kueue allows it)
    assert kueue.stale(held, kueue.workload(job(), OWNER, "q", priority=priorities.Priority(
        "WorkloadPriorityClass", "low", 10)))
    assert not kueue.stale(held, kueue.workload(job(), OWNER, "q"))  # no class named any more: left as it is


def test_topology_requests_from_kueues_annotations() -> None:
    tpu = {**TPU, "template": {"metadata": {"annotations": {topology.SLICE_TOPOLOGY: "cloud.google.com/gke-tpu-slice",
                                                            topology.REQUIRED: "kubernetes.io/hostname"}}}}
    racked = parse_job({**job([tpu, GPU]).model_dump(by_alias=True, exclude_none=True), "metadata": {
        "name": "demo", "annotations": {topology.PREFERRED: "cloud.google.com/gce-topology-block"}}})
    sets = {p["name"]: p for p in kueue.pod_sets(racked, OWNER)}
    # The TPU group's own annotations win; a slice per learner: its 4 hosts, sub-grouped by learner index.
    assert sets["tpu"]["topologyRequest"] == {
        "required": "kubernetes.io/hostname", "podSetSliceRequiredTopology": "cloud.google.com/gke-tpu-slice",
        "podSetSliceSize": 4, "podIndexLabel": n.INDEX, "subGroupIndexLabel": n.LEARNER_INDEX, "subGroupCount": 3}
    # The job's annotation for the other group; none for the syncer.
    assert sets["gpu"]["topologyRequest"] == {"preferred": "cloud.google.com/gce-topology-block",
                                              "podIndexLabel": n.INDEX}
    assert "topologyRequest" not in sets["syncer"]
    assert all("topologyRequest" not in p for p in kueue.pod_sets(job(), OWNER))


@pytest.mark.parametrize(("annotations", "problem"), [
    ({topology.REQUIRED: "a", topology.PREFERRED: "b"}, f"metadata.annotations[{topology.PREFERRED}]: {topology.REQUIRED} is set"),
    ({topology.SLICE_SIZE: "two"}, f"metadata.annotations[{topology.SLICE_SIZE}]: 'two' is not a positive integer"),
    ({topology.UNCONSTRAINED: "maybe"}, f"metadata.annotations[{topology.UNCONSTRAINED}]: 'maybe' is not true or false"),
])
def test_topology_annotations_kueue_would_refuse_are_refused(annotations: dict[str, str], problem: str) -> None:
    bad = parse_job({**job().model_dump(by_alias=True, exclude_none=True),
                     "metadata": {"name": "demo", "annotations": annotations}})
    (got,) = kueue.problems(bad)
    assert got.startswith(problem), got


def admitted_wl(assignments: list[dict[str, Any]], **status: Any) -> dict[str, Any]:
    out = {**kueue.workload(job(), OWNER, "q"), "status": {
        **wl(("QuotaReserved", "True"), ("Admitted", "True"))["status"],
        "admission": {"clusterQueue": "cq", "podSetAssignments": assignments}, **status}}
    out["metadata"] = {**out["metadata"], "name": "diloco-demo-abcde"}
    return out


def test_the_admitted_flavors_go_into_their_pod_sets_pods() -> None:
    held = admitted_wl([{"name": "tpu", "flavors": {"google.com/tpu": "spot", "cpu": "spot"}, "count": 12},
                        {"name": "gpu", "flavors": {"nvidia.com/gpu": "h100"}, "count": 2},
                        {"name": "syncer", "flavors": {"cpu": "default"}, "count": 1}])
    assert placement.flavor_names(held) == ["default", "h100", "spot"]
    infos, problems = placement.placement(held, {"h100": H100, "spot": SPOT, "default": {"metadata": {"name": "default"}}})
    assert problems == [] and placement.clashes(infos, held["spec"]["podSets"]) == []
    assert infos["gpu"].node_selector == H100["spec"]["nodeLabels"] and infos["gpu"].tolerations == H100["spec"][
        "tolerations"]
    assert infos["tpu"].node_selector == SPOT["spec"]["nodeLabels"] and len(infos["tpu"].tolerations) == 1  # once
    assert infos["syncer"] == placement.PodSetInfo(labels={kueue.POD_SET_LABEL: "syncer"})
    desired = render.children(job(), OWNER, "t" * 43, started=True, finished=False)
    placed = {(o["kind"], o["metadata"]["name"]): o for o in placement.place(desired, infos)}
    gpu = placed[("StatefulSet", "demo-gpu")]["spec"]["template"]
    assert gpu["spec"]["nodeSelector"] == H100["spec"]["nodeLabels"]
    assert gpu["spec"]["tolerations"] == H100["spec"]["tolerations"]
    assert gpu["metadata"]["labels"][kueue.POD_SET_LABEL] == "gpu"
    tpu = placed[("StatefulSet", "demo-tpu-2")]["spec"]["template"]["spec"]  # every gang of the group
    assert tpu["nodeSelector"] == {**TPU["nodeSelector"], **SPOT["spec"]["nodeLabels"]}  # the group's own kept
    assert tpu["tolerations"] == [*TPU["tolerations"], *SPOT["spec"]["tolerations"]]
    syncer = placed[("Deployment", "demo-syncer")]["spec"]["template"]
    assert "nodeSelector" not in syncer["spec"] and syncer["metadata"]["labels"][kueue.POD_SET_LABEL] == "syncer"
    assert [o for o in desired if o["kind"] not in ("StatefulSet", "Deployment")] == \
        [o for o in placed.values() if o["kind"] not in ("StatefulSet", "Deployment")]
    for obj in placed.values():
        if obj["kind"] in ("StatefulSet", "Deployment"):
            kubernetes_validate.validate(obj, "1.30", strict=True)


def test_a_topology_assignment_gates_the_pods_and_admission_checks_update_them() -> None:
    held = admitted_wl([{"name": "gpu", "flavors": {"nvidia.com/gpu": "h100"}, "count": 2,
                         "topologyAssignment": {"levels": ["kubernetes.io/hostname"], "slices": []}}],
                       admissionChecks=[{"name": "prov", "state": "Ready", "podSetUpdates": [
                           {"name": "gpu", "annotations": {"cluster-autoscaler.kubernetes.io/consume-provisioning-request":
                                                           "prov-1"}, "nodeSelector": {"reservation": "r1"}}]}])
    infos, problems = placement.placement(held, {"h100": H100})
    assert problems == []
    gpu = infos["gpu"]
    assert gpu.scheduling_gates == [kueue.TOPOLOGY_GATE]
    assert gpu.annotations == {topology.UNCONSTRAINED: "true", kueue.WORKLOAD_ANNOTATION: "diloco-demo-abcde",
                               "cluster-autoscaler.kubernetes.io/consume-provisioning-request": "prov-1"}
    assert gpu.node_selector == {**H100["spec"]["nodeLabels"], "reservation": "r1"}
    placed = placement.place(render.children(job(), OWNER, "t" * 43, started=True, finished=False), infos)
    (sts,) = [o for o in placed if o["metadata"]["name"] == "demo-gpu" and o["kind"] == "StatefulSet"]
    assert sts["spec"]["template"]["spec"]["schedulingGates"] == [{"name": kueue.TOPOLOGY_GATE}]


def test_what_keeps_an_admitted_job_from_starting() -> None:
    held = admitted_wl([{"name": "gpu", "flavors": {"nvidia.com/gpu": "gone"}, "count": 2}])
    _, problems = placement.placement(held, {"gone": None})
    assert problems == ["PodSet gpu: ResourceFlavor gone not found"]
    other = {**SPOT, "spec": {"nodeLabels": {"cloud.google.com/gke-tpu-topology": "2x2"}}}
    tpu = admitted_wl([{"name": "tpu", "flavors": {"google.com/tpu": "other"}, "count": 12}])
    infos, problems = placement.placement(tpu, {"other": other})
    assert problems == []
    (clash,) = placement.clashes(infos, tpu["spec"]["podSets"])
    assert clash == ("PodSet tpu: the admission's nodeSelector cloud.google.com/gke-tpu-topology='2x2' clashes with "
                     "the pods' '4x4'")



class Forbidding:
    """An API where the operator's RBAC may not read Kueue's cluster-scoped objects."""

    def get(self, kind: str, namespace: str | None, name: str) -> None:
        from diloco.operator.kube import KINDS, ApiError

        raise ApiError(403, "GET ...", "Forbidden", f'{KINDS[kind][1]} "{name}" is forbidden')


def test_what_the_operator_may_not_read_is_named_not_a_failed_pass() -> None:
    held = admitted_wl([{"name": "gpu", "flavors": {"nvidia.com/gpu": "h100"}, "count": 2}])
    flavors, refused = kueue_api.lookup_flavors(Forbidding(), held)  # type: ignore[arg-type]
    assert flavors == {} and refused == ['ResourceFlavor h100 cannot be read: resourceflavors "h100" is forbidden']
    assert placement.placement(held, flavors)[1] == []  # not also "not found"
    labelled = parse_job({**job().model_dump(by_alias=True, exclude_none=True),
                          "metadata": {"name": "demo", "labels": {priorities.PRIORITY_LABEL: "high"}}})
    assert kueue_api.lookup_priority(Forbidding(), labelled) == (  # type: ignore[arg-type]
        None, 'WorkloadPriorityClass high cannot be read: workloadpriorityclasses "high" is forbidden')

# -- against the emulated API server (kmock): each served Workload version ----------------------

KUEUE_RESOURCES = {"workloads": ("Workload", True), "resourceflavors": ("ResourceFlavor", False),
                   "workloadpriorityclasses": ("WorkloadPriorityClass", False)}


def serve_kueue(cluster: Any, *versions: str) -> None:
    """Kueue's CRDs as if installed, served under `versions` (and no other)."""
    import kmock

    resources = cluster.cluster.resources
    for key in [k for k in resources if k.group == "kueue.x-k8s.io"]:
        del resources[key]
    for version in versions:
        for plural, (kind, namespaced) in KUEUE_RESOURCES.items():
            resources[f"kueue.x-k8s.io/{version}/{plural}"] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=namespaced, subresources={"status"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"})


def test_discovery_prefers_the_newest_served_version_and_follows_an_upgrade(cluster: Any) -> None:
    from diloco.operator.kube import ApiError, Kube

    serve_kueue(cluster)
    kube = Kube(cluster.url)
    with pytest.raises(ApiError) as none:
        kube.list("Workload", "ns")
    assert none.value.status == 404 and "serves no version of kueue.x-k8s.io" in str(none.value)
    serve_kueue(cluster, "v1beta1")
    kube = Kube(cluster.url)
    assert kube.served_version("kueue.x-k8s.io") == "v1beta1" and kube.list("Workload", "ns") == []
    serve_kueue(cluster, "v1beta1", "v1beta2")
    assert Kube(cluster.url).served_version("kueue.x-k8s.io") == "v1beta2"
    # Kueue upgraded to a release without v1beta1: the list's 404 makes the client look again.
    serve_kueue(cluster, "v1beta2")
    assert kube.list("Workload", "ns") == [] and kube.served_version("kueue.x-k8s.io") == "v1beta2"
    assert kube.path("ResourceFlavor", None, "h100") == "apis/kueue.x-k8s.io/v1beta2/resourceflavors/h100"


def kueue_admits(api: Any, name: str, assignments: list[dict[str, Any]]) -> None:
    """What Kueue's scheduler writes when the Workload fits its ClusterQueue."""
    conds = [{"type": t, "status": "True", "reason": t, "message": t, "lastTransitionTime": "2026-01-01T00:00:00Z"}
             for t in ("QuotaReserved", "Admitted")]
    api.patch("Workload", "research", name, {"status": {"conditions": conds, "admission": {
        "clusterQueue": "cluster-queue", "podSetAssignments": assignments}}}, sub="status")


@pytest.mark.parametrize("version", ["v1beta1", "v1beta2"])
@pytest.mark.slow
def test_a_queued_job_on_each_served_version_runs_on_its_admitted_flavor(cluster: Any, api: Any, controllers: Any,
                                                                         version: str) -> None:
    """The operator as the Kueue integration, on a cluster whose Kueue serves only `version`:
    the Workload in that version with the WorkloadPriorityClass's priority; once admitted, the
    learners' pods carry the flavor's node labels and tolerations, the syncer's its own flavor's."""
    from tests.helpers import wait_for
    from tests.kube.running import OperatorThread

    serve_kueue(cluster, version)
    for flavor in (H100, {"metadata": {"name": "cpu"}, "spec": {}}):
        api.create({**flavor, "apiVersion": f"kueue.x-k8s.io/{version}", "kind": "ResourceFlavor"})
    api.create({"apiVersion": f"kueue.x-k8s.io/{version}", "kind": "WorkloadPriorityClass",
                "metadata": {"name": "high"}, "value": 1000})
    manifest = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                "metadata": {"name": "demo", "namespace": "research",
                             "labels": {kueue.QUEUE_LABEL: "training", priorities.PRIORITY_LABEL: "high"}},
                "spec": {"learnerGroups": [{"name": "gpu", "replicas": 2}], "syncer": {"fragments": 2}}}
    with OperatorThread(Config(status_interval=0.5, chaos_interval=0.25, stuck_timeout=1.0, kueue=True)) as op:
        api.create(manifest)
        (w,) = wait_for(lambda: api.list("Workload", "research", n.selector("demo")), what="the job's Workload")
        assert w["apiVersion"] == f"kueue.x-k8s.io/{version}"
        assert {k: v for k, v in w["spec"].items() if k not in ("queueName", "podSets")} == \
            priorities.priority_fields(priorities.Priority("WorkloadPriorityClass", "high", 1000), version)
        wait_for(lambda: api.get("DecoupledDiLoCoJob", "research", "demo")["spec"].get("suspend") is True,
                 what="the queued job suspended")
        op.ticks(2)
        assert not api.list("Pod", "research", n.selector("demo"))
        kueue_admits(api, w["metadata"]["name"], [
            {"name": "gpu", "flavors": {"cpu": "h100", "nvidia.com/gpu": "h100"}, "count": 2},
            {"name": "syncer", "flavors": {"cpu": "cpu"}, "count": 1}])
        learners = wait_for(lambda: (p := api.list("Pod", "research", n.selector("demo", n.LEARNER))) and
                            len(p) == 2 and p, what="the admitted job's learner pods")
        for pod in learners:
            assert pod["spec"]["nodeSelector"] == H100["spec"]["nodeLabels"]
            assert pod["spec"]["tolerations"] == H100["spec"]["tolerations"]
            assert pod["metadata"]["labels"][kueue.POD_SET_LABEL] == "gpu"
        (syncer,) = wait_for(lambda: api.list("Pod", "research", n.selector("demo", n.SYNCER)), what="the syncer pod")
        assert "nodeSelector" not in syncer["spec"] and "tolerations" not in syncer["spec"]
        job_status = api.get("DecoupledDiLoCoJob", "research", "demo")["status"]
        admitted = next(c for c in job_status["conditions"] if c["type"] == kueue.JOB_ADMITTED)
        assert (admitted["status"], admitted["reason"]) == ("True", "Admitted")


def test_without_a_served_kueue_queued_jobs_wait_and_the_others_run(cluster: Any, api: Any, controllers: Any) -> None:
    """No Kueue version the operator speaks (none installed, or only a newer one): a queued job
    stays suspended and says why; every other job keeps its children and its status."""
    from tests.helpers import wait_for
    from tests.kube.running import OperatorThread

    serve_kueue(cluster, "v1")  # a Kueue of the future
    base = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
            "spec": {"learnerGroups": [{"name": "gpu", "replicas": 1}], "syncer": {"fragments": 2}}}
    with OperatorThread(Config(status_interval=0.5, chaos_interval=0.25, stuck_timeout=1.0, kueue=True)):
        api.create({**base, "metadata": {"name": "queued", "namespace": "research",
                                         "labels": {kueue.QUEUE_LABEL: "training"}}})
        api.create({**base, "metadata": {"name": "plain", "namespace": "research"}})

        def admitted() -> dict[str, Any]:
            conds = (api.get("DecoupledDiLoCoJob", "research", "queued").get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == kueue.JOB_ADMITTED), {})

        cond = wait_for(lambda: admitted().get("reason") == "KueueNotServed" and admitted(), what="KueueNotServed")
        assert cond["status"] == "False" and "it serves v1" in cond["message"]
        assert api.get("DecoupledDiLoCoJob", "research", "queued")["spec"]["suspend"] is True
        wait_for(lambda: api.list("Pod", "research", n.selector("plain", n.LEARNER)), what="the plain job's learner")
        assert not api.list("Pod", "research", n.selector("queued"))
        events = api.request("GET", "api/v1/namespaces/research/events").get("items") or []
        assert any(e.get("reason") == "KueueNotServed" and e.get("type") == "Warning" for e in events)
