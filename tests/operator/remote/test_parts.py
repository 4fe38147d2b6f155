"""A remote part as the home operator writes it (operator/remote/parts.py), and when it must be written again."""

from __future__ import annotations

import base64
import copy
from typing import Any

from diloco.operator.remote import parts
from diloco.operator.render import exposure
from diloco.spec import KIND, parse_job

ENDPOINTS = ["shard-0.syncer.example.com:50051", "shard-1.syncer.example.com:50051"]


def home_job(**spec: Any) -> Any:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": KIND, "metadata": {"name": "big", "namespace": "ml"},
                      "spec": {"clusters": [{"name": "eu", "kubeconfigSecret": "diloco-eu"},
                                            {"name": "asia", "kubeconfigSecret": "diloco-asia", "namespace": "train"}],
                               "learnerGroups": [{"name": "us", "replicas": 2},
                                                 {"name": "eu", "region": "europe-west4", "replicas": 2, "cluster": "eu"},
                                                 {"name": "asia", "replicas": 1, "cluster": "asia"}],
                               "syncer": {"shards": 2, "expose": {"host": "syncer.example.com",
                                                                  "tls": {"secretName": "syncer-tls"}}}, **spec}})


def home(**spec: Any) -> parts.Home:
    return parts.Home(home_job(**spec), "uid-1", "s3cret", b"CA PEM", ENDPOINTS)


def test_the_part_is_a_learners_only_job_and_a_secret_naming_the_home_job() -> None:
    h = home()
    eu, asia = h.job.spec.clusters
    job = parts.desired_job(h, eu)
    assert job["metadata"] == {"name": "big", "namespace": "ml", "labels": {
        "app.kubernetes.io/managed-by": "diloco-operator", parts.HOME_JOB: "ml.big", parts.PART: "eu"},
        "annotations": {parts.HOME_UID: "uid-1"}}
    spec = parse_job(job).spec  # what the remote operator validates
    assert [(g.name, g.shard_offset) for g in spec.learner_groups] == [("eu", 2)]
    assert spec.syncer.external is not None and spec.syncer.external.addresses == ENDPOINTS
    assert spec.syncer.external.token_secret == "big-syncer" and spec.data.shards == 5
    assert parts.desired_job(h, asia)["metadata"]["namespace"] == "train"
    secret = parts.desired_secret(h, eu)
    assert secret["metadata"]["name"] == "big-syncer"
    assert {k: base64.b64decode(v) for k, v in secret["data"].items()} == {"token": b"s3cret", "ca.crt": b"CA PEM"}
    plaintext = parts.Home(h.job, "uid-1", "s3cret", None, ENDPOINTS)
    assert set(parts.desired_secret(plaintext, eu)["data"]) == {"token"}


def test_a_hand_edit_of_spec_or_data_is_put_back_but_others_metadata_stays() -> None:
    h = home()
    eu = h.job.spec.clusters[0]
    desired = parts.desired_job(h, eu)
    live = {**copy.deepcopy(desired), "status": {"phase": "Running"}}
    live["metadata"].update(resourceVersion="7", uid="r-1", labels={**desired["metadata"]["labels"], "team": "ml"},
                            managedFields=[{"manager": "kubectl"}])
    assert not parts.differs(live, desired)
    live["spec"]["learnerGroups"][0]["replicas"] = 9  # someone scaled the remote part by hand
    assert parts.differs(live, desired)
    put = parts.replacement(live, desired)
    assert put["spec"] == desired["spec"] and put["metadata"]["resourceVersion"] == "7"
    assert put["metadata"]["labels"]["team"] == "ml" and "managedFields" not in put["metadata"]
    assert parts.differs(None, desired)
    secret = parts.desired_secret(h, eu)
    assert parts.differs({**secret, "data": {"token": base64.b64encode(b"old").decode()}}, secret)


def test_an_object_of_the_same_name_that_is_not_this_home_jobs_is_not_ours() -> None:
    h = home()
    eu = h.job.spec.clusters[0]
    assert parts.owned(None, h) and parts.owned(parts.desired_job(h, eu), h)
    by_hand = parts.desired_job(h, eu)
    by_hand["metadata"]["annotations"] = {}
    assert not parts.owned(by_hand, h)
    assert not parts.owned({**by_hand, "metadata": {"annotations": {parts.HOME_UID: "uid-of-an-older-home-job"}}}, h)


def test_a_syncer_behind_a_gateway_is_dialled_at_its_listeners_port_shard_by_shard() -> None:
    routed = home_job(syncer={"shards": 2, "expose": {"type": "GRPCRoute", "host": "syncer.example.com",
                                                      "gateway": {"name": "edge", "namespace": "gateways"},
                                                      "tls": {"secretName": "syncer-tls"}}})
    endpoints = exposure.addresses(routed, {})
    assert endpoints == ["shard-0.syncer.example.com:443", "shard-1.syncer.example.com:443"]
    job = parts.desired_job(parts.Home(routed, "uid-1", "s3cret", b"CA PEM", endpoints), routed.spec.clusters[0])
    external = parse_job(job).spec.syncer.external  # what the remote operator validates
    assert external is not None and external.addresses == endpoints


def test_the_standbys_cluster_runs_its_syncers_on_the_home_token_and_the_others_dial_both() -> None:
    h = home(syncer={"shards": 2, "checkpoints": {"url": "s3://ckpt/big"},
                     "standby": {"cluster": "eu", "host": "standby.example.com"},
                     "expose": {"host": "syncer.example.com", "tls": {"secretName": "syncer-tls"}}})
    eu, asia = h.job.spec.clusters
    standby = parse_job(parts.desired_job(h, eu)).spec.syncer
    assert standby.external is None and standby.standby is not None and standby.standby.peers == ENDPOINTS
    # Its syncers' token is the home job's, from the part's Secret: good at both syncers of a shard.
    assert standby.token_secret == parts.secret_name("big") == parts.desired_secret(h, eu)["metadata"]["name"]
    external = parse_job(parts.desired_job(h, asia)).spec.syncer.external
    assert external is not None and external.addresses == [
        f"{e}|shard-{i}.standby.example.com:50051" for i, e in enumerate(ENDPOINTS)]
