"""spec.syncer.checkpoints and spec.syncer.standby rendered (issue 62): no volume with object
storage, the store's credentials from a named Secret, two syncer pods kept apart by zone, and
probes that put only the lease holder behind the Service; for a sharded syncer, the same per
shard (a Deployment and a Service each), and nothing changed without a standby."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.contract import SyncerArgs
from diloco.operator.context import Config
from diloco.operator.kueue import integration as kueue
from diloco.operator.reconcile import observe
from diloco.operator.reconcile.observe import target
from diloco.operator.render import access
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.spec import SpecError, parse_job
from tests.operator.render.test_job import OWNER, TOKEN, by_key, job, kinds, learner_container

STORE = {"url": "s3://bucket/jobs/demo", "secretName": "s3-creds"}


def syncer_pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return by_key(objs)[("Deployment", "demo-syncer")]["spec"]["template"]["spec"]


def test_checkpoints_in_object_storage_need_no_volume() -> None:
    objs = render.children(job(syncer={"checkpoints": STORE}), OWNER, TOKEN, started=False, finished=False)
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    pod = syncer_pod(objs)
    container = pod["containers"][0]
    assert n.CHECKPOINT_VOLUME not in {v["name"] for v in pod["volumes"]}
    assert n.CHECKPOINT_VOLUME not in {m["name"] for m in container["volumeMounts"]}
    args = container["args"]
    assert args[args.index("--checkpoint-dir") + 1] == "s3://bucket/jobs/demo"
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert by_key(objs)[("Deployment", "demo-syncer")]["spec"]["replicas"] == 1  # no standby asked for
    # Without a secret, the pod's own identity: no envFrom at all.
    bare = syncer_pod(render.children(job(syncer={"checkpoints": {"url": "gs://b/j"}}), OWNER, TOKEN,
                                      started=False, finished=False))
    assert "envFrom" not in bare["containers"][0]
    # A model whose size the operator cannot compute needs no size with a store: nothing to size.
    assert render.STORAGE_NEEDED not in render.name_problems(job(syncer={"checkpoints": STORE},
                                                                 model={"module": "my.model:build"}))


def test_the_default_keeps_the_volume() -> None:
    objs = render.children(job(), OWNER, TOKEN, started=False, finished=False)
    container = syncer_pod(objs)["containers"][0]
    assert container["args"][container["args"].index("--checkpoint-dir") + 1] == n.CHECKPOINT_DIR
    assert ("PersistentVolumeClaim", "demo-checkpoints") in by_key(objs)
    assert container["livenessProbe"]["tcpSocket"]["port"] == "grpc" and "affinity" not in syncer_pod(objs)


@pytest.mark.parametrize("rule", ["Required", "Preferred"])
def test_a_standby_runs_apart_by_zone_and_only_the_holder_is_ready(rule: str) -> None:
    spec = {"checkpoints": STORE, "standby": {"leaseSeconds": 6, "zoneAntiAffinity": rule}}
    objs = render.children(job(syncer=spec), OWNER, TOKEN, started=False, finished=False)
    deployment = by_key(objs)[("Deployment", "demo-syncer")]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]
    selector = {"matchLabels": n.selector("demo", n.SYNCER)}
    if rule == "Required":
        assert anti == {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": selector, "topologyKey": "topology.kubernetes.io/zone"}]}
    else:
        term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
        assert term == {"labelSelector": selector, "topologyKey": "topology.kubernetes.io/zone"}
    # The pods match the selector they avoid (each other), and the Service selects both: only
    # the one whose gRPC port is open (the lease holder) is ready, so the Service follows it.
    assert all(deployment["spec"]["template"]["metadata"]["labels"][k] == v for k, v in selector["matchLabels"].items())
    c = pod["containers"][0]
    assert c["readinessProbe"]["tcpSocket"]["port"] == "grpc"
    assert c["livenessProbe"]["tcpSocket"]["port"] == "metrics" == c["startupProbe"]["tcpSocket"]["port"]
    service = by_key(objs)[("Service", "demo-syncer")]
    assert service["spec"]["selector"] == n.selector("demo", n.SYNCER)
    assert render.name_problems(job(syncer=spec)) == []


def test_a_standby_needs_a_store() -> None:
    with pytest.raises(ValueError, match=r"spec\.syncer\.checkpoints\.url"):
        job(syncer={"standby": {}})
    with pytest.raises(ValueError, match="conditional writes"):
        job(syncer={"checkpoints": {"url": "gs://bucket/j"}, "standby": {}})
    objs = render.children(job(syncer={"checkpoints": STORE, "shards": 2}), OWNER, TOKEN, started=False,
                           finished=False)
    assert by_key(objs)[("StatefulSet", "demo-syncer")]["spec"]["volumeClaimTemplates"] == []


SHARDED = {"checkpoints": STORE, "fragments": 2, "shards": 2}
EXPOSE = {"host": "syncer.us.example.com", "tls": {"secretName": "syncer-tls"}}


def sharded_standby(rule: str = "Required", **syncer: Any) -> Any:
    return job(syncer={**SHARDED, "standby": {"leaseSeconds": 6, "zoneAntiAffinity": rule}, **syncer})


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("rule", ["Required", "Preferred"])
def test_a_sharded_standby_is_a_deployment_and_a_service_per_shard(rule: str) -> None:
    """spec.syncer.shards 2 with a standby: no StatefulSet; shard i is Deployment J-syncer-shard-i
    (2 pods, --shard i, label diloco.dev/shard, the pair apart by zone) and a ClusterIP Service of
    that name selecting its pods, which learners and the operator dial."""
    j = sharded_standby(rule)
    assert render.name_problems(j) == []  # no longer refused
    objs = by_key(render.children(j, OWNER, TOKEN, started=True, finished=False))
    syncer = {k for k in objs if objs[k]["metadata"]["labels"].get(n.COMPONENT) == n.SYNCER}
    assert syncer == {("Deployment", "demo-syncer-shard-0"), ("Deployment", "demo-syncer-shard-1"),
                      ("Service", "demo-syncer-shard-0"), ("Service", "demo-syncer-shard-1"),
                      ("NetworkPolicy", "demo-syncer"), ("PodDisruptionBudget", "demo-syncer")}
    assert not [k for k in objs if k[0] in ("StatefulSet", "PersistentVolumeClaim") and "syncer" in k[1]]
    pods: dict[int, dict[str, str]] = {}
    for i in range(2):
        deployment = objs[("Deployment", f"demo-syncer-shard-{i}")]
        spec = deployment["spec"]
        assert spec["replicas"] == 2 and spec["strategy"] == {"type": "Recreate"}
        shard_pods = {**n.selector("demo", n.SYNCER), n.SHARD: str(i)}
        assert spec["selector"] == {"matchLabels": shard_pods}
        labels = pods[i] = spec["template"]["metadata"]["labels"]
        assert labels == {**n.labels("demo", n.SYNCER), n.SHARD: str(i)}
        assert deployment["metadata"]["labels"][n.SHARD] == str(i)
        pod = spec["template"]["spec"]
        (c,) = pod["containers"]
        assert c["args"][c["args"].index("--shard") + 1] == str(i)  # explicit: no ordinal in a Deployment's pods
        assert c["args"][c["args"].index("--checkpoint-dir") + 1] == STORE["url"]  # the syncer adds /shard-<i>
        assert "volumeClaimTemplates" not in spec and n.CHECKPOINT_VOLUME not in {v["name"] for v in pod["volumes"]}
        # As the unsharded standby: only the lease holder's gRPC port opens, so only it is ready.
        assert c["readinessProbe"]["tcpSocket"]["port"] == "grpc"
        assert c["livenessProbe"]["tcpSocket"]["port"] == "metrics" == c["startupProbe"]["tcpSocket"]["port"]
        # The shard's two pods avoid each other's zone; other shards' pods do not count.
        term = {"labelSelector": {"matchLabels": shard_pods}, "topologyKey": "topology.kubernetes.io/zone"}
        anti = pod["affinity"]["podAntiAffinity"]
        assert anti == ({"requiredDuringSchedulingIgnoredDuringExecution": [term]} if rule == "Required" else
                        {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]})
        service = objs[("Service", f"demo-syncer-shard-{i}")]["spec"]
        assert "clusterIP" not in service and service["selector"] == shard_pods  # ClusterIP: follows the ready pod
        assert [p["port"] for p in service["ports"]] == [50051, 9101]
    for i in pods:  # each shard's Service (and Deployment) selects its own pods only
        selector = objs[("Service", f"demo-syncer-shard-{i}")]["spec"]["selector"]
        assert [k for k, labels in pods.items() if matches(selector, labels)] == [i]
    # The budget and the network policy cover every shard's pods; learner pods are no syncer's.
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        selector = objs[(kind, "demo-syncer")]["spec"]["podSelector" if kind == "NetworkPolicy" else "selector"]
        assert all(matches(selector["matchLabels"], labels) for labels in pods.values())
    learner = objs[("StatefulSet", "demo-us")]["spec"]["template"]
    assert not matches(objs[("Service", "demo-syncer-shard-0")]["spec"]["selector"], learner["metadata"]["labels"])
    (lc,) = learner["spec"]["containers"]
    addresses = "demo-syncer-shard-0.research.svc:50051,demo-syncer-shard-1.research.svc:50051"
    assert lc["args"][lc["args"].index("--syncer") + 1] == addresses
    assert access.link(j, "research", {}).address == addresses == target(Config(), j, OWNER, {}, TOKEN).address
    # Kueue's PodSet template (operator/kueue/integration.py): shard 0's stands for every shard's.
    assert render.syncer_pod_template(j, OWNER) == objs[("Deployment", "demo-syncer-shard-0")]["spec"]["template"]


def test_a_sharded_standbys_states_keep_the_shards_services() -> None:
    """Suspended: the shards' Services stay (their addresses do), no Deployment; finished with
    cleanPodPolicy None: both stay; finished Succeeded: neither."""
    services = {("Service", "demo-syncer-shard-0"), ("Service", "demo-syncer-shard-1")}
    deployments = {("Deployment", "demo-syncer-shard-0"), ("Deployment", "demo-syncer-shard-1")}
    suspended = kinds(render.children(sharded_standby().model_copy(update={"spec": sharded_standby().spec.model_copy(
        update={"suspend": True})}), OWNER, TOKEN, started=True, finished=False))
    assert services <= suspended and not deployments & suspended
    kept = job(syncer={**SHARDED, "standby": {}}, runPolicy={"cleanPodPolicy": "None"})
    assert services | deployments <= kinds(render.children(kept, OWNER, TOKEN, started=True, finished=True))
    done = kinds(render.children(sharded_standby(), OWNER, TOKEN, started=True, finished=True))
    assert not (services | deployments) & done


def test_an_exposed_sharded_standbys_load_balancers_select_the_shard_label() -> None:
    """Per-shard LoadBalancer Services select the shard's two pods (the ready one, the lease
    holder, gets the traffic), not a StatefulSet pod's name, which no pod carries here."""
    objs = by_key(render.children(sharded_standby(expose=EXPOSE), OWNER, TOKEN, started=True, finished=False))
    for i in range(2):
        selector = objs[("Service", f"demo-syncer-exposed-{i}")]["spec"]["selector"]
        assert selector == {**n.selector("demo", n.SYNCER), n.SHARD: str(i)} and n.POD_NAME not in selector
        assert selector == objs[("Service", f"demo-syncer-shard-{i}")]["spec"]["selector"]
    # Learners here dial the shards' Services and check each for its exposed name.
    link = access.link(sharded_standby(expose=EXPOSE), "research", {})
    assert link.server_name == "shard-0.syncer.us.example.com,shard-1.syncer.us.example.com"
    assert link.address.startswith("demo-syncer-shard-0.research.svc:50051,")


def test_without_a_standby_a_sharded_syncer_renders_as_before() -> None:
    """No standby: the StatefulSet J-syncer behind its headless Service, pods dialled by their
    names and exposed by their pod-name label, exactly as before sharded standbys existed; an
    unsharded standby: still the one Deployment of two pods behind J-syncer."""
    for j in (job(syncer=SHARDED), job(syncer={**SHARDED, "expose": EXPOSE})):
        objs = render.children(j, OWNER, TOKEN, started=True, finished=False)
        syncer = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet") and "syncer" in o["metadata"]["name"]]
        assert syncer == [render.syncer_statefulset(j, OWNER)] == render.syncer_workloads(j, OWNER)
        assert render.syncer_services(j, OWNER) == [render.syncer_service(OWNER, 2)]
        assert by_key(objs)[("Service", "demo-syncer")] == render.syncer_service(OWNER, 2)
        assert not [o for o in objs if n.SHARD in o["metadata"]["labels"]]
        template = by_key(objs)[("StatefulSet", "demo-syncer")]["spec"]["template"]
        (c,) = template["spec"]["containers"]
        assert c["args"][c["args"].index("--shard") + 1] == "ordinal" and n.SHARD not in template["metadata"]["labels"]
        assert "affinity" not in template["spec"]
        assert access.link(j, "research", {}).address == n.syncer_addresses("demo", "research", 2) == \
            "demo-syncer-0.demo-syncer.research.svc:50051,demo-syncer-1.demo-syncer.research.svc:50051"
        for i in range(2) if j.spec.syncer.expose is not None else ():
            assert by_key(objs)[("Service", f"demo-syncer-exposed-{i}")]["spec"]["selector"] == \
                {**n.selector("demo", n.SYNCER), n.POD_NAME: f"demo-syncer-{i}"}
    one = job(syncer={"checkpoints": STORE, "standby": {}})
    assert render.syncer_workloads(one, OWNER) == [render.syncer_deployment(one, OWNER)]
    assert render.syncer_services(one, OWNER) == [render.syncer_service(OWNER)]
    assert n.SHARD not in render.syncer_deployment(one, OWNER)["spec"]["template"]["metadata"]["labels"]


def test_a_sharded_standbys_shard_count_and_readiness_from_its_deployments() -> None:
    j = sharded_standby()
    ready = {("Deployment", f"demo-syncer-shard-{i}"): {"status": {"readyReplicas": 1, "replicas": 2}}
             for i in range(2)}
    assert observe.shard_problem(j, ready) == []
    assert observe.syncer_ready(j, ready)  # one ready pod a shard: the lease holders
    assert not observe.syncer_ready(j, {**ready, ("Deployment", "demo-syncer-shard-1"): {"status": {"replicas": 2}}})
    assert not observe.syncer_ready(j, {k: v for k, v in ready.items() if k[1].endswith("-0")})
    # Three shards asked of a job whose two shards run: refused, like any shard-count change.
    three = job(syncer={**SHARDED, "fragments": 3, "shards": 3, "standby": {}})
    (problem,) = observe.shard_problem(three, ready)
    assert "runs as 2 shard(s)" in problem and "set it back to 2" in problem
    assert render.shard_change_problem(three, None, None, [0, 1, 2]) is None
    # A standby added to a running sharded job: the shard count is what counts, not the workload.
    assert observe.shard_problem(j, {("StatefulSet", "demo-syncer"): {"spec": {"replicas": 2}}}) == []
    assert n.shard_of_syncer("demo", "demo-syncer-shard-12") == 12
    assert n.shard_of_syncer("demo", "demo-syncer") is n.shard_of_syncer("demo", "demo-syncer-shard-x") is None


def test_a_name_too_long_for_a_shards_service_is_refused() -> None:
    def named(name: str, shards: int) -> Any:
        return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": name},
                          "spec": {"learnerGroups": [{"name": "a", "replicas": 1}],
                                   "syncer": {**SHARDED, "fragments": 1, "shards": shards, "standby": {}}}})

    assert render.name_problems(named("j" * 48, 2)) == []  # j...-syncer-shard-1: 63 characters
    assert render.name_problems(named("j" * 48, 10)) == []  # j...-syncer-shard-9: 63 as well
    (problem,) = render.name_problems(named("j" * 48, 11))  # j...-syncer-shard-10: 64
    assert problem.startswith("metadata.name: the syncer shard's Service") and "within 47" in problem


def test_syncer_args_accept_a_url() -> None:
    assert SyncerArgs("c.yaml", checkpoint_dir="s3://b/p").argv()[-2:] == ["--checkpoint-dir", "s3://b/p"]


PEERS = ["shard-0.standby.example.com:50051", "shard-1.standby.example.com:50051"]


@pytest.mark.parametrize("shards", [1, 2])
def test_a_standby_in_another_cluster_leaves_one_syncer_a_shard_here_dialled_with_its_peer(shards: int) -> None:
    """spec.syncer.standby.peers (the home view of a standby in another cluster, or that cluster's
    part): one pod a shard, nothing to keep apart here, learners and the operator dialling both."""
    peers = PEERS[:shards] if shards > 1 else ["standby.example.com:50051"]
    j = job(syncer={"checkpoints": STORE, "standby": {"peers": peers}, "shards": shards, "fragments": 4})
    objs = by_key(render.children(j, OWNER, TOKEN, started=True, finished=False))
    workloads = [objs[("Deployment", n.syncer_shard("demo", i))] for i in range(shards)] if shards > 1 else \
        [objs[("Deployment", "demo-syncer")]]
    for w in workloads:
        assert w["spec"]["replicas"] == 1 and "affinity" not in w["spec"]["template"]["spec"]
    args = learner_container(list(objs.values()), "us")["args"]
    dialled = args[args.index("--syncer") + 1].split(",")
    assert [d.split("|")[1] for d in dialled] == peers and all(d.split("|")[0].endswith(".svc:50051") for d in dialled)
    assert target(Config(), j, OWNER, {}, TOKEN).address.split(",") == dialled
    # Kueue reserves this cluster's syncer pods only, and waits for none of them to be Ready
    # (whichever member of a pair stands by, here or there, is not).
    assert kueue.whole(j)[kueue.SYNCER_POD_SET] == shards
    assert kueue.must_be_ready(j, kueue.whole(j))[kueue.SYNCER_POD_SET] == 0
    assert observe.paired(j) and not observe.paired(sharded_standby())


def test_a_job_may_name_the_secret_that_holds_its_token() -> None:
    """spec.syncer.tokenSecret (a standby's cluster gets the home job's token so): no token
    Secret of its own, its syncers and learners mount the named one, a missing one blocks the pods."""
    j = job(syncer={"tokenSecret": "home-token"})
    objs = by_key(render.children(j, OWNER, TOKEN, started=True, finished=False,
                                  link=access.link(j, "research", {})))
    assert ("Secret", n.token_secret("demo")) not in objs
    token_volumes = [v["secret"]["secretName"] for o in objs.values() if o["kind"] in ("Deployment", "StatefulSet")
                     for v in o["spec"]["template"]["spec"]["volumes"] if v.get("name") == "token"]
    assert token_volumes and set(token_volumes) == {"home-token"}
    blocker = access.secret_blocker(j, {"home-token": None})
    assert blocker is not None and "Secret home-token (spec.syncer.tokenSecret) does not exist" in blocker.message
    assert access.secret_blocker(j, {"home-token": {"data": {"token": "dA=="}}}) is None
    with pytest.raises(SpecError, match=r"spec\.syncer\.tokenSecret: the syncer is external"):
        parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "d"},
                   "spec": {"learnerGroups": [{"name": "a", "replicas": 1, "shardOffset": 0}], "data": {"shards": 2},
                            "syncer": {"tokenSecret": "t", "external": {"endpoint": "s:1", "tokenSecret": "u"}}}})
