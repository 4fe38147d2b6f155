"""One job across clusters (`spec.clusters`): which learner groups run where, and the two specs a
home job splits into. Pure; part of the one job spec (diloco/spec/__init__.py re-exports these).

The home job is the one object a user applies: every learner group, the syncer, and the remote
clusters by name, the way Kueue's MultiKueue names its workers (a kubeconfig in a Secret in the
operator's namespace). The home operator runs `home_view` of it (diloco/spec/__init__.py), and
writes `remote_spec` of it into each remote cluster, where that cluster's own operator runs it as a learners-only job
(`spec.syncer.external`). Both are cut from the one spec, so the data slices, fragment plan and
training settings are the same everywhere by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from pydantic import Field

from diloco.spec.base import DNS_LABEL, DNS_SUBDOMAIN, Model

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
                     exposed: bool) -> Iterable[str]:
    """The rules `spec.clusters` adds; each message names its field and the fix."""
    names = [c.name for c in clusters]
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
                   f"`cluster: {c.name}` or remove the cluster")
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


def home_part(s: dict[str, Any]) -> dict[str, Any]:
    """What the home cluster runs, from the pinned spec: its own groups, and the remote groups'
    regions named for the syncer's status and metrics."""
    remote = [g for g in s["learnerGroups"] if g.get("cluster")]
    regions = s["syncer"].get("remoteRegions") or []
    syncer = {**s["syncer"], "remoteRegions": list(dict.fromkeys([*regions, *(g.get("region", "local") for g in remote)]))}
    return {**{k: v for k, v in s.items() if k != "clusters"}, "syncer": syncer,
            "learnerGroups": [g for g in s["learnerGroups"] if not g.get("cluster")]}


def remote_part(s: dict[str, Any], cluster: str, *, endpoints: list[str], token_secret: str,
                server_name: str | None) -> dict[str, Any]:
    """What cluster `cluster` runs, from the pinned spec: its groups, learners-only, dialling the home
    syncer's shards at `endpoints` with the token (and CA) in its Secret `token_secret`."""
    external: dict[str, Any] = {"endpoints": endpoints, "tokenSecret": token_secret}
    if server_name:
        external["serverName"] = server_name
    kept = {k: v for k, v in s["syncer"].items()
            if k not in ("expose", "checkpoints", "standby", "remoteRegions", "checkpointStorage")}
    return {**{k: v for k, v in s.items() if k not in ("clusters", "managedBy")}, "syncer": {**kept, "external": external},
            "learnerGroups": [{k: v for k, v in g.items() if k != "cluster"}
                              for g in s["learnerGroups"] if g.get("cluster") == cluster]}
