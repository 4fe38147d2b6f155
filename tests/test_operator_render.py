"""`spec -> manifests`, without a cluster: what exists in each state and how each child looks."""

from __future__ import annotations

from typing import Any

from diloco.operator import naming as n
from diloco.operator import render
from diloco.operator.children import plan, stamped
from diloco.spec import DecoupledDiLoCoJob, parse_job

OWNER = render.Owner("demo", "research", "uid-1")
TOKEN = "t" * 43


def job(**spec: Any) -> DecoupledDiLoCoJob:
    groups = [{"name": "us", "region": "us-central1", "replicas": 3,
               "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"},
               "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
               "resources": {"requests": {"google.com/tpu": 4, "cpu": "8"}, "limits": {"google.com/tpu": 4}}},
              {"name": "eu", "region": "europe-west4", "replicas": 1}]
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                      "metadata": {"name": "demo"}, "spec": {"learnerGroups": groups, **spec}})


def by_key(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def kinds(objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return set(by_key(objs))


def test_running_job_has_every_child_labelled_and_owned() -> None:
    objs = render.children(job(), OWNER, TOKEN, started=False, finished=False)
    assert kinds(objs) == {("ConfigMap", "demo-config"), ("Secret", "demo-token"),
                           ("PersistentVolumeClaim", "demo-checkpoints"), ("Deployment", "demo-syncer"),
                           ("Service", "demo-syncer"), ("StatefulSet", "demo-us"), ("Service", "demo-us"),
                           ("StatefulSet", "demo-eu"), ("Service", "demo-eu")}
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "research" and meta["labels"][n.JOB] == "demo"
        assert meta["ownerReferences"] == [{"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                                            "name": "demo", "uid": "uid-1", "controller": True,
                                            "blockOwnerDeletion": True}]


def test_states_suspended_before_start_after_start_and_finished() -> None:
    suspended = job(suspend=True)
    assert render.children(suspended, OWNER, TOKEN, started=False, finished=False) == []
    kept = kinds(render.children(suspended, OWNER, TOKEN, started=True, finished=False))
    always = {("ConfigMap", "demo-config"), ("Secret", "demo-token"), ("PersistentVolumeClaim", "demo-checkpoints")}
    assert kept == always | {("Deployment", "demo-syncer"), ("Service", "demo-syncer")}
    assert kinds(render.children(job(), OWNER, TOKEN, started=True, finished=True)) == always


def test_learner_statefulset() -> None:
    sts = by_key(render.children(job(), OWNER, TOKEN, started=True, finished=False))[("StatefulSet", "demo-us")]
    spec = sts["spec"]
    assert (spec["replicas"], spec["podManagementPolicy"], spec["serviceName"]) == (3, "Parallel", "demo-us")
    assert spec["selector"]["matchLabels"] == {n.JOB: "demo", n.COMPONENT: "learner", n.GROUP: "us"}
    pod = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"][n.GROUP] == "us"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"}
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["command"] == ["diloco", "learner"]
    assert c["args"] == ["--config", "/etc/diloco/job.yaml", "--group", "us", "--index", "$(POD_INDEX)",
                         "--syncer", "demo-syncer.research.svc:50051", "--metrics-port", "9100"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["DILOCO_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "demo-token", "key": "token"}
    assert TOKEN not in str(sts)  # the token travels only in the Secret
    assert c["resources"] == {"requests": {"google.com/tpu": "4", "cpu": "8"}, "limits": {"google.com/tpu": "4"}}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_syncer_deployment_service_claim_and_config() -> None:
    objs = by_key(render.children(job(syncer={"quorum": 2}), OWNER, TOKEN, started=True, finished=False))
    deploy = objs[("Deployment", "demo-syncer")]["spec"]
    assert (deploy["replicas"], deploy["strategy"]) == (1, {"type": "Recreate"})
    (c,) = deploy["template"]["spec"]["containers"]
    assert c["command"] == ["diloco", "syncer"] and "--checkpoint-dir" in c["args"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "demo-checkpoints"}} in \
        deploy["template"]["spec"]["volumes"]
    ports = {p["name"]: p["port"] for p in objs[("Service", "demo-syncer")]["spec"]["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9101}
    assert objs[("Service", "demo-us")]["spec"]["clusterIP"] == "None"
    assert objs[("PersistentVolumeClaim", "demo-checkpoints")]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    secret = objs[("Secret", "demo-token")]
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"token"}
    import yaml

    config = yaml.safe_load(objs[("ConfigMap", "demo-config")]["data"]["job.yaml"])
    assert parse_job(config).spec == job(syncer={"quorum": 2}).spec  # loadable by `diloco learner --config`


def test_big_models_get_bigger_checkpoint_volumes() -> None:
    big = job(model={"layers": 48, "dModel": 4096, "heads": 32, "context": 2048})
    claim = by_key(render.children(big, OWNER, TOKEN, started=True, finished=False))[
        ("PersistentVolumeClaim", "demo-checkpoints")]
    assert int(claim["spec"]["resources"]["requests"]["storage"].removesuffix("Gi")) > 100


def test_external_syncer_means_learners_only() -> None:
    ext = job(syncer={"external": {"endpoint": "syncer.example.com:443", "tokenSecret": "shared-token"}})
    objs = by_key(render.children(ext, OWNER, TOKEN, started=True, finished=False))
    assert ("Deployment", "demo-syncer") not in objs and ("Secret", "demo-token") not in objs
    (c,) = objs[("StatefulSet", "demo-eu")]["spec"]["template"]["spec"]["containers"]
    assert "syncer.example.com:443" in c["args"]
    assert {"name": "shared-token", "key": "token"} in [e.get("valueFrom", {}).get("secretKeyRef") for e in c["env"]]


def test_scaling_and_chaos_do_not_restart_pods_but_training_changes_do() -> None:
    def templates(j: DecoupledDiLoCoJob) -> dict[tuple[str, str], Any]:
        return {k: o["spec"]["template"] for k, o in by_key(render.children(j, OWNER, TOKEN, started=True,
                                                                            finished=False)).items()
                if "template" in o.get("spec", {})}

    base = templates(job())
    scaled = job()
    groups = [g.model_dump(by_alias=True) for g in scaled.spec.learner_groups]
    groups[0]["replicas"] = 7
    assert templates(job(learnerGroups=groups, chaos={"enabled": True, "maxConcurrent": 2})) == base
    changed = templates(job(training={"learningRate": 0.001}))
    assert changed[("StatefulSet", "demo-us")] != base[("StatefulSet", "demo-us")]
    assert changed[("Deployment", "demo-syncer")] == base[("Deployment", "demo-syncer")]


def test_names_too_long_for_a_statefulset_are_spec_problems() -> None:
    long = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                      "metadata": {"name": "a" * 20}, "spec": {"learnerGroups": [{"name": "ok"}, {"name": "b" * 40}]}})
    (problem,) = render.name_problems(long)
    assert problem.startswith("spec.learnerGroups[1].name: StatefulSet name")


def test_plan_applies_only_what_changed_and_deletes_orphans() -> None:
    desired = render.children(job(), OWNER, TOKEN, started=True, finished=False)
    live = [stamped(o) for o in desired]
    assert plan(desired, live, "uid-1").apply == [] and plan(desired, live, "uid-1").delete == []
    first = plan(desired, [], "uid-1")
    assert len(first.apply) == len(desired) and not first.delete
    fewer = render.children(job(suspend=True), OWNER, TOKEN, started=True, finished=False)
    todo = plan(fewer, live, "uid-1")
    assert [(o["kind"], o["metadata"]["name"]) for o in todo.apply] == [("ConfigMap", "demo-config")]  # suspend: true
    assert {(o["kind"], o["metadata"]["name"]) for o in todo.delete} == {
        ("StatefulSet", "demo-us"), ("Service", "demo-us"), ("StatefulSet", "demo-eu"), ("Service", "demo-eu")}
    assert plan(fewer, live, "someone-else").delete == []  # never touch what another job owns
    resized = render.children(job(model={"dModel": 4096, "heads": 32}), OWNER, TOKEN, started=True, finished=False)
    assert ("PersistentVolumeClaim", "demo-checkpoints") not in {
        (o["kind"], o["metadata"]["name"]) for o in plan(resized, live, "uid-1").apply}  # claims are create-only
