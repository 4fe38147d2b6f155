"""One job across clusters (`spec.clusters`): which learner groups run where, and the two specs a
home job splits into. Pure; part of the one job spec (diloco/spec/__init__.py re-exports these).

The home job is the one object a user applies: every learner group, the syncer, and the remote
clusters by name, the way Kueue's MultiKueue names its workers (a kubeconfig in a Secret in the
operator's namespace). The home operator runs `home_view` of it, and writes `remote_spec` of it
into each remote cluster, where that cluster's own operator runs it as a learners-only job
(`spec.syncer.external`). Both are cut from the one spec, so the data slices, fragment plan and
training settings are the same everywhere by construction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import Field

from diloco.spec.base import DNS_LABEL, DNS_SUBDOMAIN, Model

if TYPE_CHECKING:
    from diloco.spec import JobSpec

KUBECONFIG_KEY = "kubeconfig"  # the key of a remote cluster's Secret that holds its kubeconfig


class RemoteCluster(Model):
    """A cluster that runs some of the job's learner groups (`learnerGroups[].cluster`)."""

    name: str = Field(pattern=DNS_LABEL, max_length=40)
    # A Secret in the operator's namespace whose key `kubeconfig` logs in to the remote cluster's
    # API server, with only the Role docs/MULTI_CLUSTER.md lists (the chart's homeAccess values).
    kubeconfig_secret: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    # Where the remote part lives there; unset: the home job's own namespace name.
    namespace: str | None = Field(None, pattern=DNS_LABEL, max_length=63)


def cluster_problems(spec: JobSpec) -> Iterable[str]:
    """The rules `spec.clusters` adds; each message names its field and the fix."""
    names = [c.name for c in spec.clusters]
    for name in sorted({x for x in names if names.count(x) > 1}):
        yield f"spec.clusters: cluster name {name!r} is used twice; names must be unique"
    for i, g in enumerate(spec.learner_groups):
        if g.cluster is not None and g.cluster not in names:
            yield (f"spec.learnerGroups[{i}].cluster: {g.cluster!r} is not in spec.clusters "
                   f"({', '.join(names) or 'none named'}); add it there or remove the field to run the group here")
    if not spec.clusters:
        return
    used = {g.cluster for g in spec.learner_groups}
    for i, c in enumerate(spec.clusters):
        if c.name not in used:
            yield (f"spec.clusters[{i}]: no learner group runs in cluster {c.name!r}; give a group "
                   f"`cluster: {c.name}` or remove the cluster")
    if spec.syncer.external is not None:
        yield ("spec.clusters: this job's syncer is external (spec.syncer.external), so it is a remote part "
               "itself; name the remote clusters in the home job, the one that runs the syncer")
    elif spec.syncer.expose is None:
        yield ("spec.syncer.expose: learners in spec.clusters dial the syncer from outside this cluster; expose "
               "it (type LoadBalancer with a host, or GRPCRoute), with TLS")


def home_view(spec: JobSpec) -> JobSpec:
    """What the home cluster runs: its own groups, each with its data slice pinned where the whole
    job puts it, and the remote groups' regions named for the syncer's status and metrics."""
    if not spec.clusters:
        return spec
    from diloco.spec import JobSpec

    s = _pinned(spec)
    remote = [g for g in s["learnerGroups"] if g.get("cluster")]
    s["learnerGroups"] = [g for g in s["learnerGroups"] if not g.get("cluster")]
    regions = s["syncer"].get("remoteRegions") or []
    s["syncer"]["remoteRegions"] = list(dict.fromkeys([*regions, *(g.get("region", "local") for g in remote)]))
    s.pop("clusters")
    return JobSpec.model_validate(s)


def remote_spec(spec: JobSpec, cluster: str, *, endpoints: list[str], token_secret: str,
                server_name: str | None = None) -> JobSpec:
    """What cluster `cluster` runs: its groups, learners-only, dialling the home syncer's shards at
    `endpoints` with the token (and CA) in its Secret `token_secret`."""
    from diloco.spec import JobSpec

    s = _pinned(spec)
    s["learnerGroups"] = [{k: v for k, v in g.items() if k != "cluster"}
                          for g in s["learnerGroups"] if g.get("cluster") == cluster]
    external: dict[str, Any] = {"endpoints": endpoints, "tokenSecret": token_secret}
    if server_name:
        external["serverName"] = server_name
    kept = {k: v for k, v in s["syncer"].items()
            if k not in ("expose", "checkpoints", "standby", "remoteRegions", "checkpointStorage")}
    s["syncer"] = {**kept, "external": external}
    for key in ("clusters", "managedBy"):
        s.pop(key, None)
    return JobSpec.model_validate(s)


def _pinned(spec: JobSpec) -> dict[str, Any]:
    """The spec as data, every group's first shard and the job's shard count written out: cut into
    parts, each part's learners still read the slices the whole job gives them."""
    s = spec.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=True)
    s["data"] = {**s.get("data", {}), "shards": spec.shard_count}
    s["syncer"] = dict(s.get("syncer") or {})
    groups = [dict(g) for g in s["learnerGroups"]]
    for g, offset in zip(groups, spec.shard_offsets(), strict=True):
        g["shardOffset"] = offset
    s["learnerGroups"] = groups
    s.setdefault("clusters", [])
    return s
