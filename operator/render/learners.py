"""Pure `spec -> manifests` for learners: one StatefulSet per group, or per learner when a
learner spans several hosts.

A group of one-host learners (`hostsPerLearner: 1`) is one StatefulSet whose pods are its
learners (`--index $(POD_NAME)`: the ordinal from the pod's name). A learner of H > 1 hosts is
one SPMD JAX program over H processes, so it is rendered as a gang: its own StatefulSet
`<job>-<group>-<i>` of H pods, `--index i` fixed in the template and the process id from the
pod's name. Why not one
StatefulSet of H x replicas pods: the learner's hosts then keep names of their own (host 0 is
always `<gang>-0`, the coordinator), scaling a group adds or removes whole learners without
touching any other learner's pods, and one learner's hosts can be replaced together
(operator/failures/gangs.py) while the others train on. Pods start in parallel, not in order: host 0 waits in
`jax.distributed.initialize` until every host has joined, so it is never ready alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from diloco.contract import (
    COORDINATOR_ENV,
    COORDINATOR_PORT,
    LEARNER_METRICS_PORT,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    LearnerArgs,
    container_command,
)
from diloco.operator.failures import pods
from diloco.operator.render import access, compile_cache, overlay, parts
from diloco.operator.render import naming as n
from diloco.operator.render.parts import Owner
from diloco.spec import DecoupledDiLoCoJob, LearnerGroup

TPU_RESOURCE = "google.com/tpu"
TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"  # node label (and selector) of a GKE TPU slice
NODE_POOL = "cloud.google.com/gke-nodepool"  # a multi-host TPU slice is one GKE node pool
# What libtpu reads to join the hosts of a multi-host slice. GKE's webhook sets them for Indexed
# Jobs (JobSet) only, so for StatefulSet pods the operator sets them itself.
TPU_WORKER_ID, TPU_WORKER_HOSTNAMES = "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"


def config_hash(job: DecoupledDiLoCoJob, group: LearnerGroup) -> str:
    return parts.digest(job.spec.learner_inputs(group.name))


def is_gang(group: LearnerGroup) -> bool:
    return group.hosts_per_learner > 1


def statefulset_names(job: DecoupledDiLoCoJob) -> list[tuple[int, str]]:
    """(position of the group in spec.learnerGroups, StatefulSet name) of every learner workload."""
    name = job.metadata.name
    out = []
    for i, g in enumerate(job.spec.learner_groups):
        if is_gang(g):
            out += [(i, n.gang(name, g.name, k)) for k in range(g.replicas)]
        else:
            out.append((i, n.statefulset(name, g.name)))
    return out


def tpu_chips(group: LearnerGroup) -> int | None:
    """google.com/tpu chips per pod (the group's limit, else its request), if it asks for any."""
    raw = group.resources.limits.get(TPU_RESOURCE, group.resources.requests.get(TPU_RESOURCE))
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def slice_hosts(group: LearnerGroup) -> int | None:
    """Hosts of the group's TPU slice: chips of its topology over chips per pod; None if unknown."""
    topology, chips = group.node_selector.get(TPU_TOPOLOGY), tpu_chips(group)
    if not topology or not chips:
        return None
    try:
        total = math.prod(int(x) for x in topology.lower().split("x"))
    except ValueError:
        return None
    return total // chips if total % chips == 0 else None


def problems(job: DecoupledDiLoCoJob) -> list[str]:
    """Learner workloads Kubernetes would refuse, or TPU slices the learners cannot fill."""
    out: list[str] = []
    owners: dict[str, int] = {}
    names = statefulset_names(job)
    for i, g in enumerate(job.spec.learner_groups):
        longest = [name for k, name in names if k == i][-1:]  # a gang's: the highest learner index
        if longest and len(longest[0]) > n.MAX_STATEFULSET_NAME:
            within = (f"metadata.name, the group name and -<learner index> together must stay within "
                      f"{n.MAX_STATEFULSET_NAME}" if is_gang(g) else
                      f"metadata.name and the group name together must stay within {n.MAX_STATEFULSET_NAME - 1}")
            out.append(f"spec.learnerGroups[{i}].name: StatefulSet name {longest[0]!r} has {len(longest[0])} "
                       f"characters; {within}")
        hosts = slice_hosts(g)
        if hosts is not None and hosts != g.hosts_per_learner:
            out.append(f"spec.learnerGroups[{i}].hostsPerLearner: a {g.node_selector[TPU_TOPOLOGY]} TPU slice with "
                       f"{tpu_chips(g)} chips per pod ({TPU_RESOURCE}) has {hosts} host(s), and one learner takes a "
                       f"whole slice; set hostsPerLearner to {hosts}")
    for i, name in names:
        first = owners.setdefault(name, i)
        if first != i:
            out.append(f"spec.learnerGroups[{i}].name: StatefulSet {name!r} would also be a learner of group "
                       f"{job.spec.learner_groups[first].name!r}; rename one of the groups")
    return out


def learner_children(job: DecoupledDiLoCoJob, owner: Owner, group: LearnerGroup,
                     link: access.Link) -> list[dict[str, Any]]:
    """The group's headless Service and its StatefulSet (or one per learner, for gangs)."""
    if not is_gang(group):
        return [learner_service(owner, group), learner_statefulset(job, owner, group, link)]
    return [learner_service(owner, group)] + [gang_statefulset(job, owner, group, link=link, index=i)
                                              for i in range(group.replicas)]


def _affinity(owner: Owner, group: LearnerGroup, gang: str | None) -> dict[str, Any]:
    # Spread a group's learners over nodes: one failing node should cost one learner.
    spread = {"weight": 100, "podAffinityTerm": {
        "labelSelector": {"matchLabels": n.selector(owner.name, n.LEARNER)},
        "topologyKey": "kubernetes.io/hostname"}}
    if gang is None or TPU_TOPOLOGY not in group.node_selector:
        return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [spread]}}
    # A multi-host TPU learner needs all hosts of one slice (ICI joins only those), and a slice
    # is one node pool: its hosts go together into a node pool no other gang uses. Without the
    # second rule two gangs could each take part of two slices and neither would ever start.
    return {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {n.GANG: gang}}, "topologyKey": NODE_POOL}]},
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchExpressions": [{"key": n.GANG, "operator": "Exists"},
                                                       {"key": n.GANG, "operator": "NotIn", "values": [gang]}]},
                "topologyKey": NODE_POOL}],
            "preferredDuringSchedulingIgnoredDuringExecution": [spread]},
    }


def _field(path: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": path}}


def _gang_env(owner: Owner, group: LearnerGroup, index: int) -> list[dict[str, Any]]:
    """jax.distributed's coordinator, process id and count; a TPU slice's libtpu variables."""
    hosts = group.hosts_per_learner
    # The process id is the gang pod's ordinal, read from its name (every Kubernetes version;
    # the pod-index label needs 1.28). libtpu wants a bare number: TPU slices run on GKE 1.28+.
    env: list[dict[str, Any]] = [{"name": PROCESS_ID_ENV, "valueFrom": _field("metadata.name")},
           {"name": NUM_PROCESSES_ENV, "value": str(hosts)},
           {"name": COORDINATOR_ENV, "value": n.coordinator_address(owner.name, group.name, index, owner.namespace)}]
    if tpu_chips(group):
        names = [n.host_address(owner.name, group.name, index, host=h, namespace=owner.namespace) for h in range(hosts)]
        env += [{"name": TPU_WORKER_ID, "valueFrom": _field(f"metadata.labels['{n.INDEX}']")},
                {"name": TPU_WORKER_HOSTNAMES, "value": ",".join(names)}]
    return env


def pod_template(job: DecoupledDiLoCoJob, owner: Owner, group: LearnerGroup, *, link: access.Link,
                 index: int | None = None) -> dict[str, Any]:
    """A learner's pod template; `index` None: the group's StatefulSet (the index from the pod),
    else learner `index`'s gang (the host from the pod)."""
    pod_security, container_security = parts.security()
    volumes, mounts = parts.common_volumes(owner, link.token_secret)
    cache_volume, cache_mount, cache_env = compile_cache.parts(job.spec)  # a restart compiles nothing
    volumes.append(cache_volume)
    mounts.append(cache_mount)
    tls_ca, tls_server_name = None, None
    if link.ca_secret is not None:
        volume, mount = parts.tls_volume(link.ca_secret, (n.CA_KEY,))
        volumes.append(volume)
        mounts.append(mount)
        tls_ca, tls_server_name = f"{n.TLS_DIR}/{n.CA_KEY}", link.server_name or None
    args = LearnerArgs(f"{n.CONFIG_DIR}/{n.CONFIG_KEY}", group.name, "$(POD_NAME)" if index is None else index,
                       link.address, metrics_port=LEARNER_METRICS_PORT, token_file=n.TOKEN_FILE, tls_ca=tls_ca,
                       tls_server_name=tls_server_name)
    # Where the learner writes that it reached spec.training.steps (contract.Finished; operator/status/steps.py reads it).
    common = [{"name": "HOME", "value": "/tmp"}, {"name": TERMINATION_LOG_ENV, "value": TERMINATION_LOG}, *cache_env]
    ports: list[dict[str, Any]] = [{"name": "metrics", "containerPort": LEARNER_METRICS_PORT, "protocol": "TCP"}]
    labels = n.labels(owner.name, n.LEARNER, group.name)
    gang = None
    if index is None:
        # `--index $(POD_NAME)`: the learner takes the StatefulSet ordinal from its pod's name.
        env = [{"name": "POD_NAME", "valueFrom": _field("metadata.name")}, *common]
    else:
        gang = n.gang(owner.name, group.name, index)
        env = [*common, *_gang_env(owner, group, index)]
        ports.append({"name": "coordinator", "containerPort": COORDINATOR_PORT, "protocol": "TCP"})
        labels = {**labels, n.GANG: gang, n.LEARNER_INDEX: str(index)}
    container = {
        "name": n.LEARNER,
        "image": group.image,
        "command": container_command("learner"),
        "args": args.argv(),
        "env": env,
        "ports": ports,
        # Ready once joined to the syncer (the learner's /readyz), not merely started.
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
        "resources": parts.resources(group.resources),
        "securityContext": container_security,
        "volumeMounts": mounts,
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",  # never the logs: only the learner's own word ends the job
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": pod_security,
        "terminationGracePeriodSeconds": 30,  # the learner flushes its last push in under 10 s
        **parts.pod_basics(),
        "volumes": volumes,
        "affinity": _affinity(owner, group, gang),
    }
    if group.node_selector:
        pod_spec["nodeSelector"] = dict(group.node_selector)
    if group.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in group.tolerations]
    return overlay.shape({"metadata": {"labels": labels, "annotations": {n.CONFIG_HASH: config_hash(job, group)}},
                          "spec": pod_spec}, group.pod, group.template)


def _statefulset(owner: Owner, name: str, *, group: LearnerGroup, replicas: int, match: Mapping[str, str],
                 template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": parts.meta(owner, name, n.LEARNER, group.name),
        "spec": {
            "replicas": replicas,
            "serviceName": n.statefulset(owner.name, group.name),  # the group's headless Service
            # Learners never wait for each other, nor do a learner's hosts (host 0 waits for all).
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(match)},
            "template": template,
        },
    }


def learner_statefulset(job: DecoupledDiLoCoJob, owner: Owner, group: LearnerGroup,
                        link: access.Link) -> dict[str, Any]:
    return _statefulset(owner, n.statefulset(owner.name, group.name), group=group, replicas=group.replicas,
                        match=n.selector(owner.name, n.LEARNER, group.name),
                        template=pod_template(job, owner, group, link=link))


def gang_statefulset(job: DecoupledDiLoCoJob, owner: Owner, group: LearnerGroup, *, link: access.Link,
                     index: int) -> dict[str, Any]:
    """Learner `index` of a multi-host group: one pod per host, `<job>-<group>-<index>-<host>`."""
    return _statefulset(owner, n.gang(owner.name, group.name, index), group=group, replicas=group.hosts_per_learner,
                        match=n.gang_selector(owner.name, group.name, index),
                        template=pod_template(job, owner, group, link=link, index=index))


def learner_service(owner: Owner, group: LearnerGroup) -> dict[str, Any]:
    """Headless: stable per-pod DNS names for the StatefulSets, metrics scraping and, for
    multi-host learners, the coordinator (published before ready: host 0 is never ready alone)."""
    name = n.statefulset(owner.name, group.name)
    ports = [{"name": "metrics", "port": LEARNER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]
    if is_gang(group):
        ports.append({"name": "coordinator", "port": COORDINATOR_PORT, "targetPort": "coordinator", "protocol": "TCP"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": parts.meta(owner, name, n.LEARNER, group.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": n.selector(owner.name, n.LEARNER, group.name), "ports": ports}}


def ready_learners(group: LearnerGroup, job_pods: list[dict[str, Any]]) -> int:
    """Ready learners of the group, from its pods: Ready (joined to the syncer: the learner's
    readiness probe, /readyz) and not terminating, which a StatefulSet's readyReplicas does not
    promise. A multi-host learner is ready when all of its hosts are."""
    hosts: dict[int, int] = {}
    for pod in job_pods:
        found = n.learner_of(pod)
        if found is not None and found[1].group == group.name and pods.ready(pod):
            hosts[found[1].index] = hosts.get(found[1].index, 0) + 1
    return sum(1 for i, up in hosts.items() if i < group.replicas and up >= group.hosts_per_learner)
