"""A user's pod overlay (`learnerGroups[].pod`, `syncer.pod`) merged into the rendered pods."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from diloco.operator import crd
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.operator.render import strategic_merge
from diloco.spec import PodTemplate, SpecError, parse_job

OWNER = render.Owner("demo", "research", "0f5a1f4e-0000-4000-8000-000000000000")
POD = {"labels": {"team": "pretrain", n.JOB: "not-this"}, "annotations": {"cost-center": "42"},
       "serviceAccountName": "bucket-reader", "automountServiceAccountToken": True,
       "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "training-high",
       "env": [{"name": "GOOGLE_CLOUD_PROJECT", "value": "p"}],
       "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
       "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}


def job(group_pod: dict[str, Any] | None = None, syncer_pod: dict[str, Any] | None = None) -> Any:
    group: dict[str, Any] = {"name": "us", "replicas": 2, **({"pod": group_pod} if group_pod else {})}
    syncer: dict[str, Any] = {"pod": syncer_pod} if syncer_pod else {}
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                      "spec": {"learnerGroups": [group], "syncer": syncer}})


def templates(j: Any) -> dict[str, dict[str, Any]]:
    objs = render.children(j, OWNER, "t" * 43, started=True, finished=False)
    return {o["kind"]: o["spec"]["template"] for o in objs if o["kind"] in ("StatefulSet", "Deployment")}


def test_the_overlay_is_merged_under_the_operators_own_fields() -> None:
    plain, merged = templates(job())["StatefulSet"], templates(job(POD))["StatefulSet"]
    meta, spec = merged["metadata"], merged["spec"]
    assert meta["labels"]["team"] == "pretrain" and meta["labels"][n.JOB] == "demo"  # the selector stays ours
    assert meta["annotations"]["cost-center"] == "42" and n.CONFIG_HASH in meta["annotations"]
    assert (spec["serviceAccountName"], spec["automountServiceAccountToken"], spec["priorityClassName"]) == (
        "bucket-reader", True, "training-high")
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["volumes"] == [*plain["spec"]["volumes"], POD["volumes"][0]]
    (c,), (c0,) = spec["containers"], plain["spec"]["containers"]
    assert c["env"] == [*c0["env"], {"name": "GOOGLE_CLOUD_PROJECT", "value": "p"}]
    assert c["volumeMounts"] == [*c0["volumeMounts"], POD["volumeMounts"][0]]
    assert (c["args"], c["securityContext"], c["readinessProbe"]) == (c0["args"], c0["securityContext"],
                                                                      c0["readinessProbe"])
    assert templates(job(POD))["Deployment"] == templates(job())["Deployment"]  # the group's only
    assert templates(job(syncer_pod={"priorityClassName": "syncer"}))["Deployment"]["spec"]["priorityClassName"] == \
        "syncer"


def test_the_rendered_pods_are_valid_kubernetes() -> None:
    for template in templates(job(POD, {"serviceAccountName": "s"})).values():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, "1.30", strict=True)


@pytest.mark.parametrize("pod, problem", [
    ({"volumes": [{"name": "token", "emptyDir": {}}]}, "spec.learnerGroups[0].pod.volumes[0].name: 'token' is the "
                                                       "operator's"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/etc/diloco/x"}]},
     "spec.learnerGroups[0].pod.volumeMounts[0].mountPath: '/etc/diloco/x' is (inside) the operator's mount"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/data"}]},
     "spec.learnerGroups[0].pod.volumeMounts[0].name: 'nope' names no volume"),
])
def test_clashes_with_what_the_operator_mounts_are_refused_with_the_field(pod: dict[str, Any], problem: str) -> None:
    (found,) = render.name_problems(job(pod))
    assert found.startswith(problem)


def test_variables_the_operator_sets_cannot_be_overridden() -> None:
    with pytest.raises(SpecError) as err:
        job({"env": [{"name": "DILOCO_TOKEN", "value": "x"}]})
    assert str(err.value) == "spec.learnerGroups[0].pod.env[0].name: DILOCO_TOKEN is set by the operator; choose another name"


def test_the_crd_keeps_volumes_as_given() -> None:
    """Structural schemas prune unknown fields: a volume's content must survive as written."""
    pod = crd.spec_schema()["properties"]["learnerGroups"]["items"]["properties"]["pod"]["properties"]
    assert pod["volumes"]["items"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert pod["serviceAccountName"]["type"] == "string"


# -- pod templates (learnerGroups[].template, syncer.template) ---------------------------------

SIDECAR = {"name": "tcpx-daemon", "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd:v2.0.11",
           "securityContext": {"privileged": True},
           "volumeMounts": [{"name": "nvidia", "mountPath": "/usr/local/nvidia/lib64"}]}
INIT = {"name": "fetch-shards", "image": "google/cloud-sdk:slim", "command": ["gsutil", "-m", "cp", "-r"],
        "args": ["gs://corpus/shards", "/data"], "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
ZONE = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-central1-a"]}]}]}}
TEMPLATE = {
    "metadata": {"labels": {"team": "pretrain"}, "annotations": {"gke-gcsfuse/volumes": "true"}},
    "spec": {
        "initContainers": [INIT],
        "containers": [SIDECAR, {"name": "learner", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                 "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                                 "securityContext": {"readOnlyRootFilesystem": False}}],
        "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "100Gi"}},
                    {"name": "nvidia", "hostPath": {"path": "/home/kubernetes/bin/nvidia/lib64"}}],
        "affinity": {"nodeAffinity": ZONE, "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": {"labelSelector": {"matchLabels": {"team": "eval"}},
                                               "topologyKey": "kubernetes.io/hostname"}}]}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"team": "pretrain"}}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "runtimeClassName": "nvidia", "schedulerName": "volcano", "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet", "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "terminationGracePeriodSeconds": 90,
    },
}


def templated(group_template: dict[str, Any] | None = None, syncer_template: dict[str, Any] | None = None,
              **group: Any) -> Any:
    g: dict[str, Any] = {"name": "us", "replicas": 2, **group,
                         **({"template": group_template} if group_template is not None else {})}
    syncer: dict[str, Any] = {"template": syncer_template} if syncer_template is not None else {}
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                      "spec": {"learnerGroups": [g], "syncer": syncer}})


def test_a_template_adds_a_sidecar_an_init_container_and_affinity() -> None:
    j = templated(TEMPLATE, pod={"env": [{"name": "GOOGLE_CLOUD_PROJECT", "value": "p"}]},
                  tolerations=[{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}])
    assert render.name_problems(j) == []
    plain, got = templates(templated())["StatefulSet"], templates(j)["StatefulSet"]
    meta, spec = got["metadata"], got["spec"]
    assert meta["labels"]["team"] == "pretrain" and meta["labels"][n.JOB] == "demo"
    assert meta["annotations"]["gke-gcsfuse/volumes"] == "true" and n.CONFIG_HASH in meta["annotations"]
    # Containers merged by name: the learner keeps its command line, gets the env and the mount; the sidecar follows.
    assert [c["name"] for c in spec["containers"]] == ["learner", "tcpx-daemon"]
    learner, sidecar = spec["containers"]
    (before,) = plain["spec"]["containers"]
    assert (learner["image"], learner["command"], learner["args"], learner["ports"], learner["readinessProbe"]) == \
        (before["image"], before["command"], before["args"], before["ports"], before["readinessProbe"])
    assert learner["env"] == [*before["env"], {"name": "GOOGLE_CLOUD_PROJECT", "value": "p"},
                              {"name": "NCCL_DEBUG", "value": "INFO"}]  # the overlay's, then the template's
    assert learner["volumeMounts"] == [*before["volumeMounts"], {"name": "data", "mountPath": "/data", "readOnly": True}]
    assert learner["securityContext"] == {**before["securityContext"], "readOnlyRootFilesystem": False}
    assert sidecar == SIDECAR and spec["initContainers"] == [INIT]
    assert spec["volumes"] == [*plain["spec"]["volumes"], *TEMPLATE["spec"]["volumes"]]
    # Affinity: the node affinity as given; the operator's spread of learners over nodes kept, the template's appended.
    assert spec["affinity"]["nodeAffinity"] == ZONE
    assert spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        *plain["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"],
        *TEMPLATE["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]]
    assert spec["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},
                                   *TEMPLATE["spec"]["tolerations"]]
    for key in ("runtimeClassName", "schedulerName", "hostNetwork", "dnsPolicy", "nodeSelector",
                "terminationGracePeriodSeconds", "topologySpreadConstraints"):
        assert spec[key] == TEMPLATE["spec"][key], key
    assert templates(j)["Deployment"] == templates(templated())["Deployment"]  # the group's only


def test_templated_children_are_valid_kubernetes() -> None:
    """Every rendered child (StatefulSets of one-host and multi-host groups, the syncer's
    Deployment) with templates on the groups and the syncer, as the API server's schemas check them."""
    syncer = {"spec": {"containers": [{"name": "log-shipper", "image": "fluent/fluent-bit:3.1"}],
                       "priorityClassName": "training", "nodeSelector": {"pool": "cpu"}}}
    j = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                   "spec": {"learnerGroups": [{"name": "us", "replicas": 2, "template": TEMPLATE},
                                              {"name": "tpu", "replicas": 2, "hostsPerLearner": 2,
                                               "template": {"spec": {"initContainers": [INIT], "volumes": [
                                                   {"name": "data", "emptyDir": {}}]}}}],
                            "syncer": {"template": syncer}}})
    assert render.name_problems(j) == []
    objs = render.children(j, OWNER, "t" * 43, started=True, finished=False)
    rendered = [o for o in objs if o["kind"] in ("StatefulSet", "Deployment")]
    assert sorted(o["metadata"]["name"] for o in rendered) == ["demo-syncer", "demo-tpu-0", "demo-tpu-1", "demo-us"]
    for obj in rendered:
        kubernetes_validate.validate(obj, "1.30", strict=True)
        assert obj["spec"]["template"]["spec"].get("initContainers") == [INIT] or obj["metadata"]["name"] == "demo-syncer"


@pytest.mark.parametrize(("where", "template", "problem"), [
    ("group", {"spec": {"containers": [{"name": "learner", "image": "evil:latest"}]}},
     "spec.learnerGroups[0].template.spec.containers[0].image: the operator's learner container's; set by "
     "spec.learnerGroups[0].image"),
    ("group", {"spec": {"containers": [{"name": "learner", "command": ["sh"]}]}},
     "spec.learnerGroups[0].template.spec.containers[0].command: the operator's learner container's"),
    ("group", {"spec": {"containers": [{"name": "learner", "resources": {"limits": {"cpu": "1"}}}]}},
     "spec.learnerGroups[0].template.spec.containers[0].resources: the operator's learner container's; set by "
     "spec.learnerGroups[0].resources"),
    ("group", {"spec": {"containers": [{"name": "learner", "env": [{"name": "DILOCO_COORDINATOR", "value": "x"}]}]}},
     "spec.learnerGroups[0].template.spec.containers[0].env[0].name: DILOCO_COORDINATOR is set by the operator"),
    ("syncer", {"spec": {"containers": [{"name": "syncer", "ports": [{"containerPort": 1}]}]}},
     "spec.syncer.template.spec.containers[0].ports: the operator's syncer container's"),
    ("group", {"spec": {"volumes": [{"name": "token", "emptyDir": {}}]}},
     "spec.learnerGroups[0].template.spec.volumes[0].name: 'token' is the operator's"),
    ("group", {"spec": {"containers": [{"name": "learner", "volumeMounts": [{"name": "x", "mountPath": "/etc/diloco"}]}],
                        "volumes": [{"name": "x", "emptyDir": {}}]}},
     "spec.learnerGroups[0].template.spec.containers[0].volumeMounts[0].mountPath: '/etc/diloco' is (inside) the "
     "operator's mount"),
    ("group", {"metadata": {"labels": {n.JOB: "other"}}},
     f"spec.learnerGroups[0].template.metadata.labels[{n.JOB}]: the operator's"),
    ("group", {"metadata": {"annotations": {n.CONFIG_HASH: "0"}}},
     f"spec.learnerGroups[0].template.metadata.annotations[{n.CONFIG_HASH}]: the operator's"),
    ("group", {"spec": {"restartPolicy": "Never"}},
     "spec.learnerGroups[0].template.spec.restartPolicy: StatefulSets and Deployments run pods with Always only"),
    ("group", {"spec": {"hostname": "x"}}, "spec.learnerGroups[0].template.spec.hostname: the operator's"),
    ("group", {"spec": {"nodeSelector": {"pool": "b"}}},
     "spec.learnerGroups[0].template.spec.nodeSelector[pool]: 'b' clashes with spec.learnerGroups[0].nodeSelector's 'a'"),
    ("group", {"spec": {"nodeSelecter": {"pool": "a"}}},
     "spec.learnerGroups[0].template.spec.nodeSelecter: not a PodSpec field"),
    ("group", {"spec": {"containers": [{"name": "sidecar"}]}},
     "spec.learnerGroups[0].template.spec.containers[0].image: required"),
    ("group", {"spec": {"initContainers": [{"name": "a", "image": "i", "volumeMounts": [{"name": "nope",
                                                                                          "mountPath": "/x"}]}]}},
     "spec.learnerGroups[0].template.spec.initContainers[0].volumeMounts[0].name: 'nope' names no volume"),
    ("group", {"spec": {"hostNetwork": "yes"}}, "spec.learnerGroups[0].template.spec.hostNetwork: must be a boolean"),
    # Issue 50: what a strategic merge alone would let through.
    ("group", {"spec": {"schedulingGates": [{"name": "example.com/hold"}]}},
     "spec.learnerGroups[0].template.spec.schedulingGates: the operator's: the operator and Kueue gate pods"),
    ("syncer", {"spec": {"schedulingGates": [{"name": "example.com/hold"}]}},
     "spec.syncer.template.spec.schedulingGates: the operator's"),
    ("group", {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "team-a"}}},
     "spec.learnerGroups[0].template.metadata.labels[kueue.x-k8s.io/queue-name]: Kueue reads it from the job, not "
     "its pods; set it in the job's metadata.labels"),
    ("group", {"spec": {"containers": [{"name": "learner", "terminationMessagePath": "/tmp/x"}]}},
     "spec.learnerGroups[0].template.spec.containers[0].terminationMessagePath: the operator's learner container's; "
     "set by the learner-syncer contract (the learner writes there that it reached spec.training.steps)"),
    ("group", {"spec": {"containers": [{"name": "learner", "terminationMessagePolicy": "FallbackToLogsOnError"}]}},
     "spec.learnerGroups[0].template.spec.containers[0].terminationMessagePolicy: the operator's learner container's"),
    ("group", {"spec": {"containers": [{"name": "learner", "startupProbe": {"httpGet": {"path": "/readyz",
                                                                                          "port": "metrics"}}}]}},
     "spec.learnerGroups[0].template.spec.containers[0].startupProbe.httpGet.path: /readyz is readiness"),
    ("group", {"spec": {"containers": [{"name": "learner", "livenessProbe": {
        "httpGet": {"path": "/readyz", "port": "metrics"}, "initialDelaySeconds": 600}}]}},
     "spec.learnerGroups[0].template.spec.containers[0].livenessProbe.httpGet.path: /readyz is readiness"),
    ("group", {"spec": {"containers": [{"name": "learner", "livenessProbe": {
        "httpGet": {"path": "/metrics", "port": "metrics"}}}]}},
     "spec.learnerGroups[0].template.spec.containers[0].livenessProbe: the learner opens port metrics only after "
     "compiling its steps, so it would be killed in its compile; add a startupProbe"),
])
def test_a_template_that_overrides_what_the_operator_owns_is_refused_with_the_field(
        where: str, template: dict[str, Any], problem: str) -> None:
    j = templated(template, nodeSelector={"pool": "a"}) if where == "group" else templated(syncer_template=template)
    (found,) = render.name_problems(j)
    assert found.startswith(problem), found


def test_diloco_validate_shows_a_template_clash(tmp_path: Any) -> None:
    """The operator's admission check, through `diloco validate`: exit 2 with the field named."""
    import yaml

    from tests.operator.admission.test_checks import diloco

    manifest = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                "spec": {"learnerGroups": [{"name": "us", "template": {"spec": {"containers": [
                    {"name": "learner", "args": ["--steps", "1"]}]}}}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    done = diloco("validate", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "spec.learnerGroups[0].template.spec.containers[0].args: the operator's learner container's" in \
        done.stdout + done.stderr


def test_the_crd_keeps_a_template_spec_as_given() -> None:
    group = crd.spec_schema()["properties"]["learnerGroups"]["items"]["properties"]["template"]["properties"]
    assert group["spec"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert set(group["metadata"]["properties"]) == {"labels", "annotations"}
    syncer = crd.spec_schema()["properties"]["syncer"]["properties"]["template"]["properties"]
    assert syncer["spec"]["x-kubernetes-preserve-unknown-fields"] is True


# -- issue 50: the merge is a strategic merge, field by field ------------------------------------

def learner_of(j: Any) -> dict[str, Any]:
    return next(c for c in templates(j)["StatefulSet"]["spec"]["containers"] if c["name"] == "learner")


def valid(j: Any) -> None:
    for obj in render.children(j, OWNER, "t" * 43, started=True, finished=False):
        if obj["kind"] in ("StatefulSet", "Deployment"):
            kubernetes_validate.validate(obj, "1.30", strict=True)


def test_a_containers_security_context_merges_recursively() -> None:
    """securityContext.capabilities.add keeps the operator's capabilities.drop: [ALL] (a strategic merge
    recurses into maps); a list the template gives is replaced, a null removes the key."""
    plain = learner_of(templated())["securityContext"]
    assert plain["capabilities"] == {"drop": ["ALL"]}
    j = templated({"spec": {"containers": [{"name": "learner", "securityContext": {
        "capabilities": {"add": ["IPC_LOCK"]}}}], "securityContext": {"seccompProfile": {"type": "Localhost",
                                                                                             "localhostProfile": "p"}}}})
    assert render.name_problems(j) == []
    got = learner_of(j)["securityContext"]
    assert got == {**plain, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    pod = templates(j)["StatefulSet"]["spec"]["securityContext"]
    assert pod["seccompProfile"] == {"type": "Localhost", "localhostProfile": "p"} and pod["runAsNonRoot"] is True
    valid(j)
    dropped = learner_of(templated({"spec": {"containers": [{"name": "learner", "securityContext": {
        "capabilities": {"drop": ["NET_RAW"]}, "readOnlyRootFilesystem": None}}]}}))["securityContext"]
    assert dropped["capabilities"] == {"drop": ["NET_RAW"]} and "readOnlyRootFilesystem" not in dropped


def test_volumes_of_one_name_are_one_volume_never_two_sources() -> None:
    """spec.template.spec.volumes: a name the overlay (pod.volumes) has too is refused with both paths;
    one the operator has is refused (the parametrized table); merged, a same-named volume replaces
    ours as a whole, as the API's retainKeys strategy does, never key by key into two sources."""
    j = templated({"spec": {"volumes": [{"name": "data", "emptyDir": {}}]}},
                  pod={"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}]})
    (problem,) = render.name_problems(j)
    assert problem == ("spec.learnerGroups[0].template.spec.volumes[0].name: 'data' is also "
                       "spec.learnerGroups[0].pod.volumes[0]; a volume has one source: set it in one place")
    rendered = {"spec": {"containers": [{"name": "learner", "env": [{"name": "A", "value": "1"}]}],
                         "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}]}}
    merged = strategic_merge.merge_template(rendered, PodTemplate.model_validate({"spec": {
        "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "1Gi"}}],
        "containers": [{"name": "learner", "env": [{"name": "A", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.name"}}}]}]}}))
    assert merged["spec"]["volumes"] == [{"name": "data", "emptyDir": {"sizeLimit": "1Gi"}}]
    # An env var holds one source too (value or valueFrom): the template's replaces the overlay's.
    assert merged["spec"]["containers"][0]["env"] == [{"name": "A", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name"}}}]


def test_a_learner_may_have_a_liveness_probe_that_spares_its_compile() -> None:
    """livenessProbe and startupProbe on the learner are accepted (a kill only restarts it: the job
    ends on the learners' termination messages, operator/status/steps.py) when the compile is covered."""
    probes = {"startupProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 10,
                               "failureThreshold": 90},
              "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 30}}
    j = templated({"spec": {"containers": [{"name": "learner", **probes}]}})
    assert render.name_problems(j) == []
    learner = learner_of(j)
    assert (learner["startupProbe"], learner["livenessProbe"]) == (probes["startupProbe"], probes["livenessProbe"])
    assert learner["terminationMessagePath"] == "/dev/termination-log" and learner["terminationMessagePolicy"] == "File"
    valid(j)
    delayed = templated({"spec": {"containers": [{"name": "learner", "livenessProbe": {
        "exec": {"command": ["true"]}, "initialDelaySeconds": 900}}]}})
    assert render.name_problems(delayed) == []


def test_a_probe_of_the_syncer_merges_onto_the_operators() -> None:
    """syncer.template's livenessProbe: its timings merge onto the operator's probe and keep its handler;
    a handler of its own replaces the operator's (a probe has exactly one)."""
    def probe(template: dict[str, Any]) -> dict[str, Any]:
        j = templated(syncer_template={"spec": {"containers": [{"name": "syncer", "livenessProbe": template}]}})
        assert render.name_problems(j) == []
        valid(j)
        (c,) = templates(j)["Deployment"]["spec"]["containers"]
        return dict(c["livenessProbe"])

    (ours,) = templates(templated())["Deployment"]["spec"]["containers"]
    assert probe({"failureThreshold": 30}) == {**ours["livenessProbe"], "failureThreshold": 30}
    replaced = probe({"exec": {"command": ["true"]}})
    assert replaced["exec"] == {"command": ["true"]} and "tcpSocket" not in replaced


def test_diloco_validate_shows_issue_50s_refusals(tmp_path: Any) -> None:
    """`diloco validate` runs the same checks: schedulingGates, the Kueue queue label, a learner probe."""
    import yaml

    from tests.operator.admission.test_checks import diloco

    template = {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}},
                "spec": {"schedulingGates": [{"name": "hold"}], "containers": [{"name": "learner", "livenessProbe": {
                    "httpGet": {"path": "/readyz", "port": "metrics"}, "initialDelaySeconds": 60}}]}}
    manifest = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                "spec": {"learnerGroups": [{"name": "us", "template": template}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    done = diloco("validate", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    for field in ("spec.learnerGroups[0].template.metadata.labels[kueue.x-k8s.io/queue-name]",
                  "spec.learnerGroups[0].template.spec.schedulingGates",
                  "spec.learnerGroups[0].template.spec.containers[0].livenessProbe.httpGet.path"):
        assert field in done.stdout + done.stderr, (field, done.stdout + done.stderr)
