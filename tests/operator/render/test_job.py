"""`spec -> manifests`, without a cluster: what exists in each state and how each child looks."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator.reconcile.children import plan, stamped
from diloco.operator.render import access, exposure, learners
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
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
                           ("StatefulSet", "demo-eu"), ("Service", "demo-eu"), ("NetworkPolicy", "demo-syncer"),
                           ("PodDisruptionBudget", "demo-syncer")}
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "research" and meta["labels"][n.JOB] == "demo"
        if obj["kind"] == "PersistentVolumeClaim":  # the trained model outlives the job (checkpointRetention)
            assert "ownerReferences" not in meta
            continue
        assert meta["ownerReferences"] == [{"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                                            "name": "demo", "uid": "uid-1", "controller": True,
                                            "blockOwnerDeletion": True}]


def test_states_suspended_before_start_after_start_and_finished() -> None:
    suspended = job(suspend=True)
    assert render.children(suspended, OWNER, TOKEN, started=False, finished=False) == []
    kept = kinds(render.children(suspended, OWNER, TOKEN, started=True, finished=False))
    always = {("ConfigMap", "demo-config"), ("Secret", "demo-token"), ("PersistentVolumeClaim", "demo-checkpoints"),
              ("NetworkPolicy", "demo-syncer")}
    assert kept == always | {("Service", "demo-syncer")}  # no pods, the syncer's neither
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
    assert c["args"] == ["--config", "/etc/diloco/job.yaml", "--group", "us", "--index", "$(POD_NAME)",
                         "--syncer", "demo-syncer.research.svc:50051", "--metrics-port", "9100",
                         "--token-file", "/etc/diloco-token/token"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # every version has it
    assert "DILOCO_TOKEN" not in env  # a file of the Secret's volume instead (tests/operator/render/test_policies.py)
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
    shard_claims = {("PersistentVolumeClaim", f"checkpoints-demo-syncer-{i}") for i in range(3)}
    assert shard_claims <= set(objs)  # made first, under the names the claim template gives them
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
    # Finished: the shards go, their volumes (retained: not the operator's to delete) stay.
    after = kinds(render.children(sharded, OWNER, TOKEN, started=True, finished=True))
    assert after == {("ConfigMap", "demo-config"), ("Secret", "demo-token"), ("NetworkPolicy", "demo-syncer")} | \
        shard_claims


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
    pod = by_key(objs)[("StatefulSet", "demo-eu")]["spec"]["template"]["spec"]
    assert {"name": "token", "secret": {"secretName": "shared", "defaultMode": 0o440,
                                        "items": [{"key": "token", "path": "token"}]}} in pod["volumes"]
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
    assert exposure.addresses(routed, {}) == ["syncer.us.example.com:443"]  # the listener's port (expose.gateway.port)


@pytest.mark.parametrize("standby", [False, True])
def test_a_sharded_syncer_gets_a_grpc_route_and_a_backend_per_shard(standby: bool) -> None:
    gateway = {"name": "edge", "sectionName": "grpc", "port": 8443}
    store = {"checkpoints": {"url": "s3://ckpt/demo"}, "standby": {}} if standby else {}
    routed = job(syncer={"fragments": 4, "shards": 2, **store, "expose": {
        "type": "GRPCRoute", "host": "syncer.us.example.com", "gateway": gateway, "tls": {"enabled": False}}})
    objs = by_key(render.children(routed, OWNER, TOKEN, started=True, finished=False))
    for i in range(2):
        name = f"demo-syncer-exposed-{i}"
        route, backend = objs[("GRPCRoute", name)], objs[("Service", name)]
        assert route["spec"]["hostnames"] == [f"shard-{i}.syncer.us.example.com"]
        assert route["spec"]["rules"] == [{"backendRefs": [{"name": name, "port": 50051}]}]
        # Each route reaches its own shard's pods only (a takeover's new holder, with a standby).
        assert backend["spec"]["selector"] == exposure.shard_selector(routed, i)
        assert "type" not in backend["spec"] and [p["port"] for p in backend["spec"]["ports"]] == [50051]
    assert ("GRPCRoute", "demo-syncer-exposed") not in objs
    assert exposure.addresses(routed, {}) == ["shard-0.syncer.us.example.com:8443",
                                              "shard-1.syncer.us.example.com:8443"]


def test_exposed_address_is_the_host_or_the_load_balancers() -> None:
    lb = job(syncer={"expose": {"tls": {"enabled": False}}})

    def at(ingress: dict[str, str]) -> dict[tuple[str, str], Any]:
        return {("Service", "demo-syncer-exposed"): {"status": {"loadBalancer": {"ingress": [ingress]}}}}

    assert exposure.addresses(lb, {}) == []  # not provisioned yet
    assert exposure.addresses(lb, at({"ip": "198.51.100.7"})) == ["198.51.100.7:50051"]
    assert exposure.addresses(lb, at({"ip": "2001:db8::7"})) == ["[2001:db8::7]:50051"]
    assert exposure.addresses(job(**EXPOSED), {}) == ["syncer.us.example.com:50051"]


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
        ("StatefulSet", "demo-us"), ("Service", "demo-us"), ("StatefulSet", "demo-eu"), ("Service", "demo-eu"),
        ("Deployment", "demo-syncer"), ("PodDisruptionBudget", "demo-syncer")}  # every pod goes
    assert plan(fewer, live, "someone-else").delete == []  # never touch what another job owns
    resized = render.children(job(model={"dModel": 4096, "heads": 32}), OWNER, TOKEN, started=True, finished=False)
    assert ("PersistentVolumeClaim", "demo-checkpoints") not in {
        (o["kind"], o["metadata"]["name"]) for o in plan(resized, live, "uid-1").apply}  # claims are create-only


# -- multi-host learners (hostsPerLearner > 1): a gang of pods per learner ------------------

SLICE = {"name": "tpu", "region": "us-west4", "replicas": 2, "hostsPerLearner": 4,
         "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                          "cloud.google.com/gke-tpu-topology": "4x4"},
         "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
         "resources": {"requests": {"google.com/tpu": 4}, "limits": {"google.com/tpu": 4}}}


def gang_job(*groups: dict[str, Any], **spec: Any) -> DecoupledDiLoCoJob:
    return job(learnerGroups=list(groups) or [SLICE, {"name": "eu", "replicas": 1}], **spec)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_multi_host_learner_is_a_gang_of_pods_with_the_coordinator_in_its_environment() -> None:
    objs = by_key(render.children(gang_job(), OWNER, TOKEN, started=True, finished=False))
    assert {k for k in objs if k[1].startswith("demo-tpu")} == {
        ("Service", "demo-tpu"), ("StatefulSet", "demo-tpu-0"), ("StatefulSet", "demo-tpu-1")}  # one per learner
    spec = objs[("StatefulSet", "demo-tpu-1")]["spec"]
    # Four hosts started together (host 0 waits for all of them), named under the group's Service.
    assert (spec["replicas"], spec["podManagementPolicy"], spec["serviceName"]) == (4, "Parallel", "demo-tpu")
    assert spec["selector"]["matchLabels"] == {n.JOB: "demo", n.COMPONENT: "learner", n.GROUP: "tpu",
                                               n.LEARNER_INDEX: "1"}
    labels = spec["template"]["metadata"]["labels"]
    assert (labels[n.GANG], labels[n.LEARNER_INDEX], labels[n.GROUP]) == ("demo-tpu-1", "1", "tpu")
    (c,) = spec["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--index") + 1] == "1"  # fixed: the pod index is the host
    host = {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    env = env_of(c)
    # The process id from the pod's name (its ordinal; every Kubernetes version has the name).
    assert (env["DILOCO_PROCESS_ID"], env["DILOCO_NUM_PROCESSES"]) == ({"fieldRef": {"fieldPath": "metadata.name"}}, "4")
    assert env["DILOCO_COORDINATOR"] == "demo-tpu-1-0.demo-tpu.research.svc:8476"  # host 0, by its stable name
    assert "POD_NAME" not in env
    # What libtpu needs to join the slice's hosts (GKE's webhook sets it for Indexed Jobs only).
    assert env["TPU_WORKER_ID"] == host
    assert env["TPU_WORKER_HOSTNAMES"] == ",".join(f"demo-tpu-1-{h}.demo-tpu.research.svc" for h in range(4))
    assert {"name": "coordinator", "containerPort": 8476, "protocol": "TCP"} in c["ports"]
    assert c["resources"] == {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == SLICE["nodeSelector"] and pod["tolerations"] == SLICE["tolerations"]
    # One slice per learner: all hosts in one node pool, which no other gang shares.
    (together,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together == {"labelSelector": {"matchLabels": {n.GANG: "demo-tpu-1"}},
                        "topologyKey": "cloud.google.com/gke-nodepool"}
    (apart,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart["topologyKey"] == "cloud.google.com/gke-nodepool"
    assert apart["labelSelector"]["matchExpressions"] == [
        {"key": n.GANG, "operator": "Exists"}, {"key": n.GANG, "operator": "NotIn", "values": ["demo-tpu-1"]}]
    # The headless Service resolves host 0 before it is ready (it never is, alone).
    svc = objs[("Service", "demo-tpu")]["spec"]
    assert (svc["clusterIP"], svc["publishNotReadyAddresses"]) == ("None", True)
    assert svc["selector"] == {n.JOB: "demo", n.COMPONENT: "learner", n.GROUP: "tpu"}
    assert {"name": "coordinator", "port": 8476, "targetPort": "coordinator", "protocol": "TCP"} in svc["ports"]
    # The one-host group beside it renders as ever.
    eu = objs[("StatefulSet", "demo-eu")]["spec"]
    assert eu["replicas"] == 1 and n.GANG not in eu["template"]["metadata"]["labels"]
    assert objs[("Service", "demo-eu")]["spec"]["ports"] == [{"name": "metrics", "port": 9100,
                                                              "targetPort": "metrics", "protocol": "TCP"}]


def test_a_multi_node_gpu_learner_gets_the_gang_environment_but_no_tpu_rules() -> None:
    gpu = {"name": "h100", "replicas": 1, "hostsPerLearner": 2,
           "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
           "resources": {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}}
    sts = by_key(render.children(gang_job(gpu), OWNER, TOKEN, started=True, finished=False))[
        ("StatefulSet", "demo-h100-0")]["spec"]
    (c,) = sts["template"]["spec"]["containers"]
    env = env_of(c)
    assert env["DILOCO_COORDINATOR"] == "demo-h100-0-0.demo-h100.research.svc:8476"
    assert env["DILOCO_NUM_PROCESSES"] == "2" and not {"TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"} & set(env)
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert set(sts["template"]["spec"]["affinity"]) == {"podAntiAffinity"}  # only the preferred spread


def test_one_host_learners_render_exactly_as_before() -> None:
    plain = render.children(job(), OWNER, TOKEN, started=True, finished=False)
    groups = [{**g.model_dump(by_alias=True, exclude_none=True), "hostsPerLearner": 1} for g in job().spec.learner_groups]
    assert render.children(job(learnerGroups=groups), OWNER, TOKEN, started=True, finished=False) == plain
    for obj in plain:
        assert n.GANG not in str(obj) and "DILOCO_COORDINATOR" not in str(obj) and "TPU_WORKER" not in str(obj)


def test_scaling_a_gang_group_adds_or_removes_whole_learners_and_touches_no_other() -> None:
    def rendered(replicas: int) -> list[dict[str, Any]]:
        return render.children(gang_job({**SLICE, "replicas": replicas}, {"name": "eu", "replicas": 1}),
                               OWNER, TOKEN, started=True, finished=False)

    live = [stamped(o) for o in rendered(2)]
    up = plan(rendered(3), live, "uid-1")
    assert [key for key in map(lambda o: (o["kind"], o["metadata"]["name"]), up.apply)] == [
        ("ConfigMap", "demo-config"), ("StatefulSet", "demo-tpu-2")] and not up.delete  # the config: replicas
    down = plan(rendered(1), live, "uid-1")
    assert {(o["kind"], o["metadata"]["name"]) for o in down.delete} == {("StatefulSet", "demo-tpu-1")}
    assert [o["metadata"]["name"] for o in down.apply] == ["demo-config"]
    # Training changes restart every gang (their template), as they do one-host learners.
    changed = plan(render.children(gang_job(training={"learningRate": 0.001}), OWNER, TOKEN, started=True,
                                   finished=False), live, "uid-1")
    assert {"demo-tpu-0", "demo-tpu-1", "demo-eu"} <= {o["metadata"]["name"] for o in changed.apply}


def test_gang_problems_slice_hosts_name_lengths_and_collisions() -> None:
    (wrong,) = render.name_problems(gang_job({**SLICE, "hostsPerLearner": 2}))
    assert wrong.startswith("spec.learnerGroups[0].hostsPerLearner: a 4x4 TPU slice with 4 chips per pod "
                            "(google.com/tpu) has 4 host(s)") and wrong.endswith("set hostsPerLearner to 4")
    single = {**SLICE, "hostsPerLearner": 1, "nodeSelector": {**SLICE["nodeSelector"],
                                                              "cloud.google.com/gke-tpu-topology": "2x4"},
              "resources": {"limits": {"google.com/tpu": 8}}}
    assert render.name_problems(gang_job(single)) == []  # 2x4 on an 8-chip host: one host
    collide = render.name_problems(gang_job({"name": "a", "replicas": 1, "hostsPerLearner": 2},
                                            {"name": "a-0", "replicas": 1}))
    assert collide == ["spec.learnerGroups[1].name: StatefulSet 'demo-a-0' would also be a learner of group 'a'; "
                       "rename one of the groups"]
    long = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                      "metadata": {"name": "a" * 20},
                      "spec": {"learnerGroups": [{"name": "b" * 29, "replicas": 12, "hostsPerLearner": 2}]}})
    (problem,) = render.name_problems(long)  # 20 + 1 + 29 fits one StatefulSet, not "-11" more
    assert problem.startswith(f"spec.learnerGroups[0].name: StatefulSet name '{'a' * 20}-{'b' * 29}-11' has 53")


def learner_pod(name: str, group: str, ready: bool = True, index: int | None = None,
                terminating: bool = False) -> dict[str, Any]:
    labels = {n.JOB: "demo", n.GROUP: group, n.COMPONENT: n.LEARNER}
    labels |= {n.LEARNER_INDEX: str(index), n.GANG: f"demo-{group}-{index}"} if index is not None else {}
    meta: dict[str, Any] = {"name": name, "labels": labels}
    meta |= {"deletionTimestamp": "2027-01-01T00:00:00Z"} if terminating else {}
    return {"metadata": meta, "status": {"phase": "Running",
                                         "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_ready_learners_come_from_ready_pods_not_terminating_ones_and_a_gang_needs_every_host() -> None:
    group = gang_job().spec.learner_groups[0]
    pods = [learner_pod(f"demo-tpu-0-{h}", "tpu", index=0) for h in range(4)]
    pods += [learner_pod(f"demo-tpu-1-{h}", "tpu", index=1, ready=h != 2) for h in range(4)]
    assert learners.ready_learners(group, pods) == 1  # learner 1's host 2 is not ready
    one_host = job().spec.learner_groups[0]
    us = [learner_pod("demo-us-0", "us"), learner_pod("demo-us-1", "us", terminating=True), learner_pod("x-eu-0", "eu")]
    assert learners.ready_learners(one_host, us) == 1  # Ready but terminating is leaving: not counted


def test_the_checkpoint_volume_is_sized_from_the_spec_or_set_by_hand() -> None:
    """A 1B model's volume from its shapes alone (diloco/shapes.py: no JAX in the operator's
    image): 1.1e9 parameters x 8 bytes (Θ and momentum) x 4 checkpoints (3 kept, 1 being written), x 2."""
    big = job(model={"preset": "llama-1b"})
    claim = by_key(render.children(big, OWNER, TOKEN, started=True, finished=False))[
        ("PersistentVolumeClaim", "demo-checkpoints")]
    assert claim["spec"]["resources"]["requests"]["storage"] == "66Gi"
    assert render.checkpoint_storage(job(syncer={"checkpointStorage": "3Ti"}).spec) == "3Ti"
    sharded = by_key(render.children(job(syncer={"fragments": 4, "shards": 2, "checkpointStorage": "700Mi"}),
                                     OWNER, TOKEN, started=True, finished=False))
    assert sharded[("StatefulSet", "demo-syncer")]["spec"]["volumeClaimTemplates"][0]["spec"]["resources"] == \
        {"requests": {"storage": "700Mi"}}


def test_a_users_own_module_needs_the_volume_size_named() -> None:
    own = job(model={"module": "my_models.wide:build"})
    (problem,) = render.name_problems(own)
    assert problem.startswith("spec.syncer.checkpointStorage:") and "spec.model.module" in problem
    assert render.name_problems(job(model={"module": "my_models.wide:build"},
                                    syncer={"checkpointStorage": "20Gi"})) == []
