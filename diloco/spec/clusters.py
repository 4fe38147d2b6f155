"""One job across clusters (`spec.clusters`): which learner groups run where, and the two specs a
home job splits into. Pure; part of the one job spec (diloco/spec/__init__.py re-exports these).

The home job is the one object a user applies: every learner group, the syncer, and the remote
clusters by name, the way Kueue's MultiKueue names its workers (a kubeconfig in a Secret in the
operator's namespace). The home operator runs `home_view` of it (diloco/spec/__init__.py), and
writes `remote_spec` of it into each remote cluster, where that cluster's own operator runs it as a learners-only job
(`spec.syncer.external`), or, in the cluster that runs the standby (`spec.syncer.standby.cluster`),
as a job whose syncer is each shard's other member. Both are cut from the one spec, so the data
slices, fragment plan and training settings are the same everywhere by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from pydantic import Field

from diloco.contract import ALTERNATE
from diloco.spec.base import DNS_LABEL, DNS_SUBDOMAIN, Model
from diloco.spec.syncer import Expose

KUBECONFIG_KEY = "kubeconfig"  # the key of a remote cluster's Secret that holds its kubeconfig


class RemoteCluster(Model):
    """A cluster that runs some of the job's learner groups (`learnerGroups[].cluster`)."""

    name: str = Field(pattern=DNS_LABEL, max_length=40)
    # A Secret in the operator's namespace whose key `kubeconfig` logs in to the remote cluster's
    # API server, with only the Role docs/MULTI_CLUSTER.md lists (the chart's homeAccess values).
    kubeconfig_secret: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    # Where the remote part lives there; unset: the home job's own namespace name.
    namespace: str | None = Field(None, pattern=DNS_LABEL, max_length=63)


class Placed(Protocol):
    """A learner group, as the cluster rules read it."""

    @property
    def cluster(self) -> str | None: ...


def cluster_problems(clusters: Sequence[RemoteCluster], groups: Sequence[Placed], *, external: bool,
                     exposed: bool, standby: str | None = None) -> Iterable[str]:
    """The rules `spec.clusters` adds (`standby`: spec.syncer.standby.cluster); each message names
    its field and the fix."""
    names = [c.name for c in clusters]
    if standby is not None and standby not in names:
        yield (f"spec.syncer.standby.cluster: {standby!r} is not in spec.clusters ({', '.join(names) or 'none named'}); "
               "add it there, or remove the field to run the standby beside the active syncer")
    for name in sorted({x for x in names if names.count(x) > 1}):
        yield f"spec.clusters: cluster name {name!r} is used twice; names must be unique"
    for i, g in enumerate(groups):
        if g.cluster is not None and g.cluster not in names:
            yield (f"spec.learnerGroups[{i}].cluster: {g.cluster!r} is not in spec.clusters "
                   f"({', '.join(names) or 'none named'}); add it there or remove the field to run the group here")
    if not clusters:
        return
    used = {g.cluster for g in groups}
    for i, c in enumerate(clusters):
        if c.name not in used:
            yield (f"spec.clusters[{i}]: no learner group runs in cluster {c.name!r}; give a group "
                   f"`cluster: {c.name}` or remove the cluster"
                   + (" (the standby's cluster runs a job of its own, with learners)" if c.name == standby else ""))
    if external:
        yield ("spec.clusters: this job's syncer is external (spec.syncer.external), so it is a remote part "
               "itself; name the remote clusters in the home job, the one that runs the syncer")
    elif not exposed:
        yield ("spec.syncer.expose: learners in spec.clusters dial the syncer from outside this cluster; expose "
               "it (type LoadBalancer or GRPCRoute, with a host), with TLS")


def pinned(spec: dict[str, Any], shard_count: int, offsets: Sequence[int]) -> dict[str, Any]:
    """The spec (as data) with every group's first shard and the job's shard count written out: cut
    into parts, each part's learners still read the slices the whole job gives them."""
    s = {**spec, "data": {**spec.get("data", {}), "shards": shard_count}, "syncer": dict(spec.get("syncer") or {})}
    s["learnerGroups"] = [{**g, "shardOffset": offset} for g, offset in zip(spec["learnerGroups"], offsets, strict=True)]
    return s


def shard_hosts(host: str, shards: int) -> list[str]:
    """The names other clusters dial an exposed syncer by, in shard order: `host`, or for a
    sharded syncer `shard-<i>.<host>` (covered by a `*.<host>` certificate)."""
    return [host] if shards == 1 else [f"shard-{i}.{host}" for i in range(shards)]


def standby_addresses(s: dict[str, Any]) -> list[str]:
    """Where the other clusters dial a standby that runs in another cluster (spec.syncer.standby
    `cluster` and `host`), one host:port a shard: exposed there as the home syncer is here."""
    syncer = s["syncer"]
    port = Expose.model_validate(syncer.get("expose") or {}).port
    return [f"{h}:{port}" for h in shard_hosts(syncer["standby"]["host"], int(syncer.get("shards", 1)))]


def _standby_cluster(s: dict[str, Any]) -> str | None:
    return (s["syncer"].get("standby") or {}).get("cluster")


def _regions(groups: Iterable[dict[str, Any]], known: Sequence[str] = ()) -> list[str]:
    return list(dict.fromkeys([*known, *(g.get("region", "local") for g in groups)]))


def _paired(standby: dict[str, Any], peers: list[str]) -> dict[str, Any]:
    """A standby whose other member runs elsewhere, at `peers` (one a shard)."""
    return {**{k: v for k, v in standby.items() if k not in ("cluster", "host")}, "peers": peers}


def home_part(s: dict[str, Any]) -> dict[str, Any]:
    """What the home cluster runs, from the pinned spec: its own groups, and the remote groups'
    regions named for the syncer's status and metrics; with the standby in another cluster, one
    syncer a shard, paired with the standby's addresses there."""
    remote = [g for g in s["learnerGroups"] if g.get("cluster")]
    syncer = {**s["syncer"], "remoteRegions": _regions(remote, s["syncer"].get("remoteRegions") or [])}
    if _standby_cluster(s) is not None:
        syncer["standby"] = _paired(syncer["standby"], standby_addresses(s))
    return {**{k: v for k, v in s.items() if k != "clusters"}, "syncer": syncer,
            "learnerGroups": [g for g in s["learnerGroups"] if not g.get("cluster")]}


def remote_part(s: dict[str, Any], cluster: str, *, endpoints: list[str], token_secret: str,
                server_name: str | None) -> dict[str, Any]:
    """What cluster `cluster` runs, from the pinned spec: its groups, learners-only, dialling the home
    syncer's shards at `endpoints` (and the standby's, where it runs in another cluster) with the
    token (and CA) in its Secret `token_secret`; or, in the standby's cluster, its groups and one
    syncer a shard paired with the home syncer's at `endpoints`, with that token as its own."""
    mine = [{k: v for k, v in g.items() if k != "cluster"} for g in s["learnerGroups"] if g.get("cluster") == cluster]
    rest = {k: v for k, v in s.items() if k not in ("clusters", "managedBy")}
    if _standby_cluster(s) == cluster:
        syncer = s["syncer"]
        others = [g for g in s["learnerGroups"] if g.get("cluster") != cluster]
        expose = {**syncer["expose"], "host": syncer["standby"]["host"]}
        return {**rest, "learnerGroups": mine, "syncer": {
            **syncer, "standby": _paired(syncer["standby"], endpoints), "expose": expose, "tokenSecret": token_secret,
            "remoteRegions": _regions(others, syncer.get("remoteRegions") or [])}}
    if _standby_cluster(s) is not None:
        endpoints = [f"{home}{ALTERNATE}{standby}" for home, standby in zip(endpoints, standby_addresses(s), strict=True)]
    external: dict[str, Any] = {"endpoints": endpoints, "tokenSecret": token_secret}
    if server_name:
        external["serverName"] = server_name
    kept = {k: v for k, v in s["syncer"].items()
            if k not in ("expose", "checkpoints", "standby", "remoteRegions", "checkpointStorage")}
    return {**rest, "syncer": {**kept, "external": external}, "learnerGroups": mine}
