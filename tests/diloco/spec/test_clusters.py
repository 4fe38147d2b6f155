"""One job across clusters (diloco/spec/clusters.py): the rules spec.clusters adds, and the home
and remote specs cut from one home job, whose learners read the slices the whole job gives them."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.spec import SpecError, home_view, parse_job, remote_spec

EXPOSED = {"shards": 2, "expose": {"host": "syncer.example.com", "tls": {"secretName": "syncer-tls"}}}
ENDPOINTS = ["shard-0.syncer.example.com:50051", "shard-1.syncer.example.com:50051"]


def home(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
            "spec": {"clusters": [{"name": "eu", "kubeconfigSecret": "diloco-eu"},
                                  {"name": "asia", "kubeconfigSecret": "diloco-asia", "namespace": "training"}],
                     "learnerGroups": [{"name": "us", "region": "us-central2", "replicas": 2},
                                       {"name": "eu", "region": "europe-west4", "replicas": 3, "cluster": "eu"},
                                       {"name": "asia", "region": "asia-southeast1", "replicas": 1, "cluster": "asia"}],
                     "syncer": EXPOSED, **spec}}


def problems(manifest: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_job(manifest)
    return info.value.problems


def test_the_home_cluster_runs_its_own_groups_on_the_slices_the_whole_job_gives_them() -> None:
    spec = parse_job(home()).spec
    view = home_view(spec)
    assert [g.name for g in view.learner_groups] == ["us"]
    assert (view.data.shards, view.learner_groups[0].shard_offset) == (6, 0)
    assert view.syncer.remote_regions == ["europe-west4", "asia-southeast1"]  # the syncer names them
    assert view.clusters == [] and view.syncer.expose == spec.syncer.expose and view.syncer.shards == 2
    single = parse_job(home(clusters=[], learnerGroups=[{"name": "us", "replicas": 2}], syncer={})).spec
    assert home_view(single) is single  # a one-cluster job is untouched


def test_a_remote_part_is_a_learners_only_job_dialling_every_shard() -> None:
    spec = parse_job(home(training={"steps": 500})).spec
    eu = remote_spec(spec, "eu", endpoints=ENDPOINTS, token_secret="j-syncer")
    assert [(g.name, g.shard_offset, g.cluster) for g in eu.learner_groups] == [("eu", 2, None)]
    assert eu.data.shards == 6 and eu.training.steps == 500 and eu.clusters == []
    ext = eu.syncer.external
    assert ext is not None and ext.addresses == ENDPOINTS and ext.token_secret == "j-syncer"
    assert (eu.syncer.expose, eu.syncer.shards) == (None, 2)
    asia = remote_spec(spec, "asia", endpoints=ENDPOINTS, token_secret="j-syncer", server_name="syncer.example.com")
    assert [(g.name, g.shard_offset) for g in asia.learner_groups] == [("asia", 5)]
    assert asia.syncer.external is not None and asia.syncer.external.server_name == "syncer.example.com"
    # What learners read is the same in every part: the plan, the data, the training.
    for part in (eu, asia, home_view(spec)):
        assert (part.syncer.plan_size, part.shard_count, part.training) == (8, 6, spec.training)


def test_clusters_are_named_once_used_and_reached_through_an_exposed_syncer() -> None:
    bad_group = home()
    bad_group["spec"]["learnerGroups"][1]["cluster"] = "europe"
    assert problems(bad_group)[0] == ("spec.learnerGroups[1].cluster: 'europe' is not in spec.clusters (eu, asia); "
                                      "add it there or remove the field to run the group here")
    unused = home(clusters=[{"name": "eu", "kubeconfigSecret": "a"}, {"name": "asia", "kubeconfigSecret": "b"},
                            {"name": "idle", "kubeconfigSecret": "c"}])
    assert problems(unused) == ["spec.clusters[2]: no learner group runs in cluster 'idle'; give a group "
                                "`cluster: idle` or remove the cluster"]
    twice = home(clusters=[{"name": "eu", "kubeconfigSecret": "a"}, {"name": "eu", "kubeconfigSecret": "b"},
                           {"name": "asia", "kubeconfigSecret": "c"}])
    assert "spec.clusters: cluster name 'eu' is used twice; names must be unique" in problems(twice)
    hidden = home(syncer={"shards": 2})
    assert problems(hidden)[0].startswith("spec.syncer.expose: learners in spec.clusters dial the syncer from outside")


STANDBY = {**EXPOSED, "checkpoints": {"url": "s3://ckpt/j"},
           "standby": {"cluster": "eu", "host": "standby.example.com", "leaseSeconds": 4}}
STANDBY_AT = ["shard-0.standby.example.com:50051", "shard-1.standby.example.com:50051"]


def test_a_standby_in_another_cluster_pairs_one_syncer_a_shard_here_with_one_there() -> None:
    spec = parse_job(home(syncer=STANDBY)).spec
    view = home_view(spec)
    standby = view.syncer.standby
    assert standby is not None and standby.peers == STANDBY_AT and standby.cluster is None and standby.host is None
    assert standby.lease_seconds == 4 and view.syncer.expose == spec.syncer.expose
    # The standby's cluster runs its groups and each shard's other syncer, exposed at the standby's host.
    eu = remote_spec(spec, "eu", endpoints=ENDPOINTS, token_secret="j-syncer")
    assert eu.syncer.external is None and eu.syncer.standby is not None and eu.syncer.standby.peers == ENDPOINTS
    assert eu.syncer.expose is not None and eu.syncer.expose.host == "standby.example.com"
    assert eu.syncer.checkpoints == spec.syncer.checkpoints and [g.name for g in eu.learner_groups] == ["eu"]
    assert eu.syncer.remote_regions == ["us-central2", "asia-southeast1"]
    assert eu.syncer.token_secret == "j-syncer"  # the home job's token, as its syncers' own
    # Every other cluster's learners dial both syncers of each shard.
    asia = remote_spec(spec, "asia", endpoints=ENDPOINTS, token_secret="j-syncer")
    assert asia.syncer.external is not None
    assert asia.syncer.external.addresses == [f"{e}|{s}" for e, s in zip(ENDPOINTS, STANDBY_AT, strict=True)]
    for part in (eu, asia, view):  # the same plan, data and training everywhere, as for any part
        assert (part.syncer.plan_size, part.shard_count, part.training) == (8, 6, spec.training)


@pytest.mark.parametrize(("standby", "says"), [
    ({"cluster": "mars", "host": "s.example.com"}, "spec.syncer.standby.cluster: 'mars' is not in spec.clusters"),
    ({"cluster": "eu"}, "spec.syncer.standby: `cluster` (the cluster that runs the standby) and `host`"),
    ({"host": "s.example.com"}, "spec.syncer.standby: `cluster` (the cluster that runs the standby) and `host`"),
    ({"cluster": "eu", "host": "s.example.com", "peers": ["a:1", "b:2"]}, "spec.syncer.standby.peers: written by"),
    ({"peers": ["a:1"]}, "spec.syncer.standby.peers: 1 address(es) for a syncer of 2 shard(s)"),
])
def test_a_standby_elsewhere_is_named_whole(standby: dict[str, Any], says: str) -> None:
    found = problems(home(syncer={**STANDBY, "standby": standby}))
    assert any(p.startswith(says) for p in found), found
