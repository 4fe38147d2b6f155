"""`spec -> manifests`, without a cluster: what exists in each state and how each child looks."""

from __future__ import annotations

from typing import Any

from diloco.operator import access, exposure, render
from diloco.operator import naming as n
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


def test_a_sharded_syncer_is_a_statefulset_with_a_volume_per_shard() -> None:
    sharded = job(syncer={"fragments": 6, "shards": 3})
    objs = by_key(render.children(sharded, OWNER, TOKEN, started=True, finished=False))
    assert ("Deployment", "demo-syncer") not in objs and ("PersistentVolumeClaim", "demo-checkpoints") not in objs
    sts = objs[("StatefulSet", "demo-syncer")]["spec"]
    assert (sts["replicas"], sts["serviceName"], sts["podManagementPolicy"]) == (3, "demo-syncer", "Parallel")
    (c,) = sts["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--shard") + 1] == "ordinal"  # from the pod's hostname, any version
    assert {"name": "checkpoints", "mountPath": n.CHECKPOINT_DIR} in c["volumeMounts"]
    assert not [v for v in sts["template"]["spec"]["volumes"] if v["name"] == "checkpoints"]
    (claim,) = sts["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "checkpoints" and "ownerReferences" not in claim["metadata"]
    assert objs[("Service", "demo-syncer")]["spec"]["clusterIP"] == "None"  # per-pod names for the shards
    (learner,) = objs[("StatefulSet", "demo-us")]["spec"]["template"]["spec"]["containers"]
    assert learner["args"][learner["args"].index("--syncer") + 1] == ",".join(
        f"demo-syncer-{i}.demo-syncer.research.svc:50051" for i in range(3))
    # Finished: the shards go, their volumes (not the operator's to delete) stay.
    after = kinds(render.children(sharded, OWNER, TOKEN, started=True, finished=True))
    assert after == {("ConfigMap", "demo-config"), ("Secret", "demo-token")}


def test_the_shard_count_of_a_running_syncer_cannot_change() -> None:
    one, three = job(), job(syncer={"fragments": 6, "shards": 3})
    deployment, sts = {"spec": {"replicas": 1}}, {"spec": {"replicas": 3}}
    assert render.shard_change_problem(one, None, None) is None  # nothing runs yet
    assert render.shard_change_problem(one, deployment, None) is None
    assert render.shard_change_problem(three, None, sts) is None
    assert render.shard_change_problem(three, deployment, None).startswith(
        "spec.syncer.shards: the job's syncer runs as 1 shard(s), and the shard count cannot change")
    assert "set it back to 3" in render.shard_change_problem(one, None, sts)
    assert "set it back to 3" in render.shard_change_problem(job(syncer={"fragments": 6, "shards": 2}), None, sts)


def test_big_models_get_bigger_checkpoint_volumes() -> None:
    big = job(model={"layers": 48, "dModel": 4096, "heads": 32, "context": 2048})
    claim = by_key(render.children(big, OWNER, TOKEN, started=True, finished=False))[
        ("PersistentVolumeClaim", "demo-checkpoints")]
    assert int(claim["spec"]["resources"]["requests"]["storage"].removesuffix("Gi")) > 100


REMOTE = {"syncer": {"external": {"endpoint": "syncer.example.com:50051", "tokenSecret": "shared",
                                   "serverName": "syncer.internal"}},
          "data": {"shards": 8}}


def remote_job() -> DecoupledDiLoCoJob:
    groups = [{"name": "eu", "region": "europe-west4", "replicas": 2, "shardOffset": 4},
              {"name": "asia", "region": "asia-southeast1", "replicas": 2, "shardOffset": 6}]
    return job(learnerGroups=groups, **REMOTE)


def learner_container(objs: list[dict[str, Any]], group: str) -> dict[str, Any]:
    (c,) = by_key(objs)[("StatefulSet", f"demo-{group}")]["spec"]["template"]["spec"]["containers"]
    return dict(c)


def test_external_syncer_means_learners_only() -> None:
    plain = access.link(remote_job(), "research", {"shared": {"data": {"token": "dA=="}}})
    objs = render.children(remote_job(), OWNER, TOKEN, started=True, finished=False, link=plain)
    assert kinds(objs) == {("ConfigMap", "demo-config"), ("StatefulSet", "demo-eu"), ("Service", "demo-eu"),
                           ("StatefulSet", "demo-asia"), ("Service", "demo-asia")}  # no syncer, PVC or token
    c = learner_container(objs, "eu")
    assert c["args"][c["args"].index("--syncer") + 1] == "syncer.example.com:50051" and "--tls-ca" not in c["args"]
    assert {"name": "shared", "key": "token"} in [e.get("valueFrom", {}).get("secretKeyRef") for e in c["env"]]
    # A CA in the copied Secret turns TLS on, checked for the certificate's name.
    tls = access.link(remote_job(), "research", {"shared": {"data": {"token": "dA==", "ca.crt": "Y2E="}}})
    objs = render.children(remote_job(), OWNER, TOKEN, started=True, finished=False, link=tls)
    c = learner_container(objs, "asia")
    assert c["args"][-4:] == ["--tls-ca", "/etc/diloco-tls/ca.crt", "--tls-server-name", "syncer.internal"]
    pod = by_key(objs)[("StatefulSet", "demo-asia")]["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "shared", "defaultMode": 0o440,
                                      "items": [{"key": "ca.crt", "path": "ca.crt"}]}} in pod["volumes"]
    # Blocked (Secret missing, token refused): no pods at all, only the config.
    assert kinds(render.children(remote_job(), OWNER, TOKEN, started=True, finished=False, blocked=True,
                                 link=tls)) == {("ConfigMap", "demo-config")}


EXPOSED = {"syncer": {"expose": {"host": "syncer.us.example.com", "annotations": {"team": "ml", "lb": "mine"},
                                 "loadBalancerSourceRanges": ["203.0.113.0/24"],
                                 "tls": {"secretName": "syncer-tls"}}}}


def test_exposed_syncer_gets_a_load_balancer_and_tls() -> None:
    exposed = job(**EXPOSED)
    link = access.link(exposed, "research", {})
    objs = by_key(render.children(exposed, OWNER, TOKEN, started=True, finished=False, link=link,
                                  expose_annotations={"lb": "chart", "dns": "chart"}))
    svc = objs[("Service", "demo-syncer-exposed")]
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["loadBalancerSourceRanges"] == ["203.0.113.0/24"]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["grpc"]  # metrics stay inside the cluster
    assert svc["metadata"]["annotations"] == {"lb": "mine", "dns": "chart", "team": "ml"}  # the job's win
    assert svc["spec"]["selector"] == objs[("Service", "demo-syncer")]["spec"]["selector"]
    (syncer,) = objs[("Deployment", "demo-syncer")]["spec"]["template"]["spec"]["containers"]
    assert syncer["args"][-4:] == ["--tls-cert", "/etc/diloco-tls/tls.crt", "--tls-key", "/etc/diloco-tls/tls.key"]
    # Learners in this cluster dial the in-cluster Service, over TLS, checked for the exposed name.
    c = learner_container(list(objs.values()), "us")
    assert c["args"][c["args"].index("--syncer") + 1] == "demo-syncer.research.svc:50051"
    assert c["args"][-4:] == ["--tls-ca", "/etc/diloco-tls/ca.crt", "--tls-server-name", "syncer.us.example.com"]
    # Exposure settings do not restart the syncer; the TLS files do (they are in the template).
    other = job(syncer={"expose": {**EXPOSED["syncer"]["expose"], "annotations": {}}})
    assert render.syncer_config_hash(other) == render.syncer_config_hash(exposed)
    plain = job(syncer={"expose": {"tls": {"enabled": False}}})
    objs = by_key(render.children(plain, OWNER, TOKEN, started=True, finished=False))
    assert "--tls-ca" not in learner_container(list(objs.values()), "us")["args"]
    assert "annotations" not in objs[("Service", "demo-syncer-exposed")]["metadata"]


def test_grpc_route_attaches_to_the_gateway() -> None:
    routed = job(syncer={"expose": {"type": "GRPCRoute", "host": "syncer.us.example.com",
                                    "gateway": {"name": "edge", "namespace": "gateways", "sectionName": "grpc"},
                                    "tls": {"enabled": False}}})
    route = by_key(render.children(routed, OWNER, TOKEN, started=True, finished=False))[("GRPCRoute",
                                                                                          "demo-syncer-exposed")]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"] == {
        "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge",
                        "namespace": "gateways", "sectionName": "grpc"}],
        "hostnames": ["syncer.us.example.com"],
        "rules": [{"backendRefs": [{"name": "demo-syncer", "port": 50051}]}]}
    assert exposure.problems(routed, gateway_api=False)[0].startswith("spec.syncer.expose.type: GRPCRoute needs")
    assert exposure.problems(routed, gateway_api=True) == []
    assert exposure.address(routed, None) == "syncer.us.example.com"


def test_exposed_address_is_the_host_or_the_load_balancers() -> None:
    lb = job(syncer={"expose": {"tls": {"enabled": False}}})
    assert exposure.address(lb, None) == ""  # not provisioned yet
    assert exposure.address(lb, {"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}]}}}) == \
        "198.51.100.7:50051"
    assert exposure.address(lb, {"status": {"loadBalancer": {"ingress": [{"ip": "2001:db8::7"}]}}}) == \
        "[2001:db8::7]:50051"
    assert exposure.address(job(**EXPOSED), None) == "syncer.us.example.com:50051"


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
