"""A multi-cluster job's pass (operator/reconcile/regions.py, through plan()): the home cluster
renders its own groups only, each remote cluster's part is written once the syncer's shards have
addresses, and the job's status shows every cluster, as the CRD's status schema allows."""

from __future__ import annotations

from typing import Any

from diloco.operator.reconcile.observe import Observed
from diloco.operator.reconcile.plan import plan
from diloco.operator.remote import health
from diloco.operator.render import naming as n
from diloco.operator.status import conditions as c
from diloco.operator.status import job as st
from diloco.spec import home_view
from tests.operator.reconcile.test_plan import T0, TOKEN, body, observed

CLUSTERS = {"clusters": [{"name": "eu", "kubeconfigSecret": "diloco-eu"}],
            "learnerGroups": [{"name": "us", "replicas": 2}, {"name": "eu", "region": "europe-west4", "replicas": 2,
                                                              "cluster": "eu"}],
            "syncer": {"shards": 2, "expose": {"host": "s.example.com", "tls": {"enabled": False}}}}


def multi(**read: Any) -> Observed:
    o = observed(body(**CLUSTERS))
    assert o.job is not None
    home = o.job.model_copy(update={"spec": home_view(o.job.spec)})
    eu = o.job.spec.clusters[0]
    return Observed(o.body, o.config, T0, home, [], [], None, token=TOKEN, whole=o.job,
                    remotes=(health.Seen(eu, "ml", kube="eu-client"),), **read)


def test_the_home_cluster_renders_its_own_groups_and_writes_the_remote_part() -> None:
    p = plan(multi(), T0)
    kinds = {(x["kind"], x["metadata"]["name"]) for x in p.desired or []}
    assert ("StatefulSet", n.statefulset("demo", "us")) in kinds
    assert ("StatefulSet", n.statefulset("demo", "eu")) not in kinds  # the eu cluster's operator runs it
    assert {("Service", n.exposed_syncer("demo", i)) for i in (0, 1)} <= kinds
    # The shards' addresses come from expose.host: the part is written at once, Secret first.
    assert [(w.cluster, w.verb, w.kind) for w in p.remote_writes] == [
        ("eu", "create", "Secret"), ("eu", "create", "DecoupledDiLoCoJob")]
    part = p.remote_writes[1].body
    assert part is not None and part["spec"]["syncer"]["external"]["endpoints"] == [
        "shard-0.s.example.com:50051", "shard-1.s.example.com:50051"]
    assert [x["name"] for x in p.status["clusters"]] == ["eu"] and p.status["clusters"][0]["reachable"]
    assert c.is_true(p.status["conditions"], health.CONDITION)
    assert st.changed({}, p.status)  # fits the CRD's status schema (changed validates what it returns)


def test_a_lost_cluster_keeps_the_home_job_running() -> None:
    first = plan(multi(), T0)
    o = multi()
    lost = Observed(o.body | {"status": first.status}, o.config, T0 + 10, o.job, [], [], None, token=TOKEN,
                    whole=o.whole, remotes=(health.Seen(o.remotes[0].cluster, "ml", problem="cannot be reached"),))
    p = plan(lost, T0 + 10)
    assert p.outcome == "ok" and p.remote_writes == ()
    assert not c.is_true(p.status["conditions"], health.CONDITION)
    assert any(getattr(e, "reason", "") == health.UNREACHABLE for e in p.events)
    assert p.status["phase"] != "Failed"
