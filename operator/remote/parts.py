"""What the home operator writes into a remote cluster for a job, and whether what is there differs. Pure.

A remote part is two objects in the cluster's namespace: the learners-only job cut from the home
job (diloco/spec/clusters.py `remote_spec`), dialling every shard of the home syncer at its
exposed address, and Secret `J-syncer` with the home job's token and the syncer's CA, which that
job names (in the cluster that runs the standby, spec.syncer.standby.cluster, the job runs each
shard's other syncer with that token as its own, spec.syncer.tokenSecret, so that every
learner's token is good at both syncers). Both carry labels naming the home job, so an operator
(or a person) there can tell who owns them; the remote cluster's own operator runs the job as
any job of its own.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.operator.render import naming as n
from diloco.spec import KIND, DecoupledDiLoCoJob, RemoteCluster, dump_job, remote_spec

HOME_JOB = "diloco.dev/home-job"  # <namespace>.<name> of the home job, on both objects
HOME_UID = "diloco.dev/home-uid"  # the home job's uid: a part of a deleted and re-created home job is not ours
PART = "diloco.dev/remote-part"  # the remote cluster's name in the home job's spec.clusters


@dataclass(frozen=True)
class Home:
    """What every part of one home job is cut from: the job, where it lives, how its syncer is reached."""

    job: DecoupledDiLoCoJob
    uid: str
    token: str
    ca: bytes | None  # the syncer's CA (its TLS Secret's ca.crt); None: plaintext
    endpoints: list[str]  # every shard's exposed host:port, in shard order ([] until known)

    @property
    def name(self) -> str:
        return self.job.metadata.name

    @property
    def namespace(self) -> str:
        return self.job.metadata.namespace or "default"


def namespace_of(home: Home, cluster: RemoteCluster) -> str:
    return cluster.namespace or home.namespace


def secret_name(job: str) -> str:
    """The remote part's Secret: the home job's token (and the syncer's CA) for its learners (and,
    in the standby's cluster, its syncers)."""
    return n.syncer(job)


def labels(home: Home, cluster: RemoteCluster) -> dict[str, str]:
    return {"app.kubernetes.io/managed-by": n.MANAGER, HOME_JOB: f"{home.namespace}.{home.name}",
            PART: cluster.name}


def desired_job(home: Home, cluster: RemoteCluster) -> dict[str, Any]:
    """The remote job, as a manifest; None-free, in the CRD's camelCase."""
    spec = remote_spec(home.job.spec, cluster.name, endpoints=home.endpoints, token_secret=secret_name(home.name))
    part = DecoupledDiLoCoJob(metadata=home.job.metadata.model_copy(update={
        "namespace": namespace_of(home, cluster), "labels": {}, "annotations": {}}), spec=spec)
    body = dump_job(part)
    body["metadata"] = {"name": home.name, "namespace": namespace_of(home, cluster),
                        "labels": labels(home, cluster), "annotations": {HOME_UID: home.uid}}
    return body


def desired_secret(home: Home, cluster: RemoteCluster) -> dict[str, Any]:
    data = {n.TOKEN_KEY: home.token.encode()}
    if home.ca:
        data[n.CA_KEY] = home.ca
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name(home.name), "namespace": namespace_of(home, cluster),
                         "labels": labels(home, cluster), "annotations": {HOME_UID: home.uid}},
            "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())}}


def differs(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """Whether `live` must be written: missing, or its spec (a job) or data (a Secret), or the
    labels and annotations we set, not what we want. Fields others add to metadata stay theirs;
    anything under spec or data is ours, so a hand edit there is put back."""
    if live is None:
        return True
    body = "spec" if desired["kind"] == KIND else "data"
    meta, want = live.get("metadata") or {}, desired["metadata"]
    return (live.get(body) != desired[body]
            or any((meta.get("labels") or {}).get(k) != v for k, v in want["labels"].items())
            or any((meta.get("annotations") or {}).get(k) != v for k, v in want["annotations"].items()))


def owned(live: Mapping[str, Any] | None, home: Home) -> bool:
    """Whether `live` is this home job's (a name clash with someone else's object is not overwritten)."""
    if live is None:
        return True
    meta = live.get("metadata") or {}
    return (meta.get("annotations") or {}).get(HOME_UID) == home.uid


def replacement(live: Mapping[str, Any] | None, desired: dict[str, Any]) -> dict[str, Any]:
    """What a PUT sends: `desired`, keeping the live object's other metadata and its resourceVersion
    (a write that lost a race to another writer is refused, and the next pass tries again)."""
    if live is None:
        return desired
    meta = dict(live.get("metadata") or {})
    for key in ("labels", "annotations"):
        meta[key] = {**(meta.get(key) or {}), **desired["metadata"][key]}
    return {**desired, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}

