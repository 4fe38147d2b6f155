"""A sharded syncer exposed shard by shard (spec.syncer.shards > 1 with spec.syncer.expose): one
LoadBalancer Service per shard pod, dialled from other clusters as `shard-<i>.<host>`, and the
home cluster's learners and operator checking each shard for that name. Pure render tables."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator.context import Config
from diloco.operator.reconcile.observe import target
from diloco.operator.render import access, exposure, policies
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from tests.operator.render.test_job import EXPOSED, OWNER, TOKEN, by_key, job, learner_container

HOST = "syncer.us.example.com"
SHARDED = {"syncer": {**EXPOSED["syncer"], "fragments": 2, "shards": 3}}


def sharded(**expose: Any) -> Any:
    return job(syncer={**SHARDED["syncer"], "expose": {**SHARDED["syncer"]["expose"], **expose}})


def rendered(j: Any, **kw: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return by_key(render.children(j, OWNER, TOKEN, started=True, finished=False,
                                  link=access.link(j, OWNER.namespace, {}), **kw))


def services(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: o for (kind, name), o in objs.items() if kind == "Service" and "exposed" in name}


@pytest.mark.parametrize(("spec", "names"), [
    (EXPOSED, ["demo-syncer-exposed"]),  # unsharded: one Service, as before
    ({"syncer": {**EXPOSED["syncer"], "fragments": 2, "shards": 2}}, ["demo-syncer-exposed-0", "demo-syncer-exposed-1"]),
    (SHARDED, ["demo-syncer-exposed-0", "demo-syncer-exposed-1", "demo-syncer-exposed-2"]),
])
def test_one_load_balancer_per_shard(spec: dict[str, Any], names: list[str]) -> None:
    j = job(**spec)
    objs = rendered(j, expose_annotations={"lb": "chart", "dns": "chart"})
    exposed = services(objs)
    assert sorted(exposed) == names == n.exposed_syncers("demo", j.spec.syncer.shards)
    for svc in exposed.values():
        assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["loadBalancerSourceRanges"] == ["203.0.113.0/24"]
        assert svc["spec"]["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP",
                                         "appProtocol": "grpc"}]  # metrics stay inside the cluster
        assert svc["metadata"]["annotations"] == {"lb": "mine", "dns": "chart", "team": "ml"}  # the job's win
        assert svc["metadata"]["labels"] == n.labels("demo", n.SYNCER)
        assert svc["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_each_shards_service_selects_that_shards_pod_alone() -> None:
    objs = rendered(sharded())
    template = objs[("StatefulSet", "demo-syncer")]["spec"]["template"]["metadata"]["labels"]
    # The StatefulSet controller adds each pod's own name as a label (every Kubernetes version).
    pods = {i: {**template, n.POD_NAME: f"demo-syncer-{i}"} for i in range(3)}
    for i, svc in enumerate(services(objs)[f"demo-syncer-exposed-{s}"] for s in range(3)):
        selector = svc["spec"]["selector"]
        assert selector == {**n.selector("demo", n.SYNCER), n.POD_NAME: f"demo-syncer-{i}"}
        assert [p for p, labels in pods.items() if selector.items() <= labels.items()] == [i]
    # Learner pods never match (the component label), so a shard's Service is its own pod's.
    learner = objs[("StatefulSet", "demo-us")]["spec"]["template"]["metadata"]["labels"]
    assert not any(s["spec"]["selector"].items() <= learner.items() for s in services(objs).values())


def test_the_shards_addresses_are_their_names_under_the_host_in_shard_order() -> None:
    j = sharded()
    assert exposure.addresses(j, {}) == [f"shard-{i}.{HOST}:50051" for i in range(3)]
    # What status.syncer.exposedAddress shows, and a remote cluster's learners pass as --syncer.
    assert ",".join(exposure.addresses(j, {})) == \
        f"shard-0.{HOST}:50051,shard-1.{HOST}:50051,shard-2.{HOST}:50051"
    assert exposure.addresses(job(syncer={"fragments": 2, "shards": 3}), {}) == []  # not exposed


def test_home_learners_dial_the_pods_and_check_each_shard_for_its_exposed_name() -> None:
    c = learner_container(list(rendered(sharded()).values()), "us")
    args = c["args"]
    assert args[args.index("--syncer") + 1] == ",".join(
        f"demo-syncer-{i}.demo-syncer.research.svc:50051" for i in range(3))
    assert args[-4:] == ["--tls-ca", "/etc/diloco-tls/ca.crt", "--tls-server-name",
                         f"shard-0.{HOST},shard-1.{HOST},shard-2.{HOST}"]
    # In plaintext: no names to check.
    plain = learner_container(list(rendered(sharded(tls={"enabled": False})).values()), "us")["args"]
    assert "--tls-server-name" not in plain and "--tls-ca" not in plain


def test_the_operator_checks_each_shard_for_its_exposed_name() -> None:
    j = sharded()
    secrets = {"syncer-tls": {"data": {"tls.crt": "Yw==", "tls.key": "aw==", "ca.crt": "Y2E="}}}
    t = target(Config(), j, OWNER, secrets, TOKEN)
    assert t.address == n.syncer_addresses("demo", "research", 3) and t.ca == b"ca"
    assert t.server_name == f"shard-0.{HOST},shard-1.{HOST},shard-2.{HOST}"
    # Unsharded: the one host, as before.
    one = target(Config(), job(**EXPOSED), OWNER, secrets, TOKEN)
    assert one.server_name == HOST


def test_every_shard_takes_grpc_from_any_source() -> None:
    objs = rendered(sharded(), peers=policies.Peers(metrics_from=()))
    policy = objs[("NetworkPolicy", "demo-syncer")]["spec"]
    (grpc,) = policy["ingress"]
    assert grpc == {"ports": [{"port": 50051, "protocol": "TCP"}]}  # no `from`: the load balancers' clients
    template = objs[("StatefulSet", "demo-syncer")]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= template.items()  # every shard's pod


def test_suspended_keeps_every_shards_service_and_expose_removed_prunes_them() -> None:
    from diloco.operator.reconcile.children import plan

    suspended = by_key(render.children(sharded().model_copy(update={"spec": sharded().spec.model_copy(
        update={"suspend": True})}), OWNER, TOKEN, started=True, finished=False))
    assert len(services(suspended)) == 3  # load balancers' addresses survive a suspension
    live = list(rendered(sharded()).values())
    unexposed = job(syncer={"fragments": 2, "shards": 3})
    deleted = {o["metadata"]["name"] for o in plan(render.children(unexposed, OWNER, TOKEN, started=True,
                                                                  finished=False), live, OWNER.uid).delete}
    assert deleted == {f"demo-syncer-exposed-{i}" for i in range(3)}


def test_a_name_too_long_for_the_shards_services_is_refused() -> None:
    def named(name: str, shards: int) -> Any:
        from diloco.spec import parse_job
        return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": name},
                          "spec": {"learnerGroups": [{"name": "a", "replicas": 1}],
                                   "syncer": {**SHARDED["syncer"], "shards": shards}}})

    assert exposure.name_problems(named("j" * 46, 3)) == []  # j...-syncer-exposed-2: 63 characters
    (problem,) = exposure.name_problems(named("j" * 46, 12))  # j...-syncer-exposed-11: 64
    assert problem.startswith("metadata.name: the exposed syncer's Service") and "within 45" in problem
    assert render.name_problems(named("j" * 46, 12)) == [problem]
    assert exposure.name_problems(named("j" * 48, 1)) == []  # unsharded: j...-syncer-exposed, 63
