"""spec.syncer.checkpoints and spec.syncer.standby rendered (issue 62): no volume with object
storage, the store's credentials from a named Secret, two syncer pods kept apart by zone, and
probes that put only the lease holder behind the Service."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.contract import SyncerArgs
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from tests.operator.render.test_job import OWNER, TOKEN, by_key, job

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


def test_a_standby_needs_a_store_and_one_shard_here() -> None:
    with pytest.raises(ValueError, match=r"spec\.syncer\.checkpoints\.url"):
        job(syncer={"standby": {}})
    with pytest.raises(ValueError, match="conditional writes"):
        job(syncer={"checkpoints": {"url": "gs://bucket/j"}, "standby": {}})
    sharded = job(syncer={"checkpoints": STORE, "standby": {}, "shards": 2})
    assert render.STANDBY_SHARDED in render.name_problems(sharded)
    objs = render.children(job(syncer={"checkpoints": STORE, "shards": 2}), OWNER, TOKEN, started=False,
                           finished=False)
    assert by_key(objs)[("StatefulSet", "demo-syncer")]["spec"]["volumeClaimTemplates"] == []


def test_syncer_args_accept_a_url() -> None:
    assert SyncerArgs("c.yaml", checkpoint_dir="s3://b/p").argv()[-2:] == ["--checkpoint-dir", "s3://b/p"]
