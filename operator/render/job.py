"""Pure `spec -> manifests`: everything the operator creates for one job, as plain dicts.

No I/O and no clock, so every rule here is tested without a cluster. `children()` decides
which parts exist in each state (running, suspended, finished, blocked on a Secret); the
builders below (operator/render/learners.py for the learners, operator/render/policies.py for the NetworkPolicy, the
disruption budget and what a finished or deleted job keeps) say how each part looks. Learner pods
find the syncer through the `access.Link` (its Service, or another cluster's endpoint);
learners and syncer read the job token from a file of a Secret volume, never from args or env.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Collection, Mapping
from typing import Any

import yaml

from diloco.contract import (
    SHARD_FROM_HOSTNAME,
    SYNCER_GRPC_PORT,
    SYNCER_METRICS_PORT,
    SyncerArgs,
    container_command,
)
from diloco.operator.render import access, exposure, learners, overlay, parts, policies
from diloco.operator.render import naming as n
from diloco.operator.render.parts import Owner, meta
from diloco.shapes import parameter_shapes
from diloco.spec import DecoupledDiLoCoJob, JobSpec, dump_job


def name_problems(job: DecoupledDiLoCoJob) -> list[str]:
    """Names that Kubernetes would refuse later (learners' StatefulSets, exposed Services), TPU
    slices the learners cannot fill, and a checkpoint volume nobody can size; reported like spec
    errors, with the field path."""
    syncer = job.spec.syncer
    sized = syncer.checkpoint_storage is not None or syncer.checkpoints is not None or \
        parameter_shapes(job.spec.model) is not None
    return (learners.problems(job) + exposure.name_problems(job) + overlay.job_problems(job)
            + ([] if sized else [STORAGE_NEEDED]) + shard_service_problems(job))


ZONE = "topology.kubernetes.io/zone"


def sharded_standby(job: DecoupledDiLoCoJob) -> bool:
    """A sharded syncer with a standby: a Deployment of two pods and a Service per shard."""
    return job.spec.syncer.shards > 1 and job.spec.syncer.standby is not None


def syncer_members(job: DecoupledDiLoCoJob) -> int:
    """Syncer pods a shard here: two with a standby, one without, and one when the standby pair's
    other member runs in another cluster (spec.syncer.standby.peers)."""
    standby = job.spec.syncer.standby
    return 2 if standby is not None and not standby.elsewhere else 1


def shard_service_problems(job: DecoupledDiLoCoJob) -> list[str]:
    """A sharded standby's per-shard Service name (`J-syncer-shard-<i>`) must stay a DNS label."""
    if not sharded_standby(job):
        return []
    shards = job.spec.syncer.shards
    return n.service_name_problems(job.metadata.name, n.syncer_shard(job.metadata.name, shards - 1),
                                   "the syncer shard's Service", f"spec.syncer.standby and {shards} shards")


def shard_change_problem(job: DecoupledDiLoCoJob, deployment: Mapping[str, Any] | None,
                         statefulset: Mapping[str, Any] | None, shard_deployments: Collection[int] = ()) -> str | None:
    """A running syncer's shard count is fixed: each shard's checkpoint holds the fragments it
    owns, so new shards would start from Θ₀ beside the old syncer. Refused like a spec error.
    What runs: the one Deployment, the StatefulSet's replicas, or (a sharded syncer with a
    standby) `shard_deployments`, the shards whose own Deployment exists."""
    running = 1 if deployment else int((statefulset or {}).get("spec", {}).get("replicas") or 0) or \
        (max(shard_deployments) + 1 if shard_deployments else 0)
    if not running or running == job.spec.syncer.shards:
        return None
    return (f"spec.syncer.shards: the job's syncer runs as {running} shard(s), and the shard count cannot change "
            f"while it runs (each shard's checkpoint holds only its own fragments); set it back to {running}")


def children(job: DecoupledDiLoCoJob, owner: Owner, token: str, *, started: bool, finished: bool,
             blocked: bool = False, link: access.Link | None = None,
             expose_annotations: Mapping[str, str] | None = None, outcome: policies.Outcome | None = None,
             peers: policies.Peers | None = None) -> list[dict[str, Any]]:
    """The children that should exist now.

    Suspended before it ever ran: nothing (Kueue admits jobs by un-suspending them). Suspended
    later: no pods at all, the syncer's included (a suspended job holds no compute); its state
    stays (checkpoint volume, config, token, Services, so addresses survive) and a resume
    restores the syncer from its last checkpoint. Blocked (a Secret it names is missing, the
    syncer refuses its token): the state only. Finished (`outcome`: how, when known): the
    state, plus the pods spec.runPolicy.cleanPodPolicy keeps. A cluster whose syncer is
    external runs learners only: no syncer, checkpoint volume or token of its own.
    """
    spec = job.spec
    if spec.suspend and not started:
        return []
    link = link or access.link(job, owner.namespace, {})
    peers = peers or policies.Peers()
    external = spec.syncer.external is not None
    out = [config_map(job, owner)]
    if not external:
        own = [token_secret(owner, token)] if spec.syncer.token_secret is None else []  # else one the job names
        out += [*own, policies.network_policy(job, owner, peers)]
        out += [policies.retained(spec, claim) for claim in checkpoint_claims(spec, owner)]
    if blocked:
        return out
    if finished:
        keep_syncer = not external and policies.keeps_syncer(spec, outcome)
        out += [*syncer_workloads(job, owner), *syncer_services(job, owner)] if keep_syncer else []
        if spec.run_policy.clean_pod_policy == "None":
            out += [x for group in spec.learner_groups for x in learners.learner_children(job, owner, group, link)]
        return out
    if not external:
        out += syncer_services(job, owner)
        if spec.syncer.expose is not None:
            out += exposure.exposed(job, owner.namespace, owner.uid, expose_annotations or {})
    if spec.suspend:
        return out
    if not external:
        out += [*syncer_workloads(job, owner), policies.disruption_budget(owner)]
    for group in spec.learner_groups:
        out += learners.learner_children(job, owner, group, link)
    return out


def config_map(job: DecoupledDiLoCoJob, owner: Owner) -> dict[str, Any]:
    """The validated manifest, defaults filled in, exactly what `diloco learner/syncer --config` loads."""
    manifest = dump_job(job)
    manifest.pop("status", None)
    manifest["metadata"] = {"name": owner.name, "namespace": owner.namespace}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(owner, n.config_map(owner.name)),
            "data": {n.CONFIG_KEY: yaml.safe_dump(manifest, sort_keys=False)}}


def token_secret(owner: Owner, token: str) -> dict[str, Any]:
    encoded = base64.b64encode(token.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta(owner, n.token_secret(owner.name)),
            "type": "Opaque", "data": {n.TOKEN_KEY: encoded}}


def checkpoint_bytes(spec: JobSpec) -> int | None:
    """Room for the checkpoints the syncer keeps, as its own code sizes them, from the model's
    shapes as the spec fixes them (no JAX: the operator runs from the syncer image). None for a
    user's own module, whose shapes only its code knows."""
    from diloco.checkpoint import disk_bytes, state_bytes

    shapes = parameter_shapes(spec.model)
    if shapes is None:
        return None
    # With room for momentum buffers even at the default outer momentum 0, which keeps none:
    # spec.syncer.outerMomentum may be turned on later, and a claim does not grow by itself.
    return disk_bytes(state_bytes(shapes, momentum=True))


def checkpoint_storage(spec: JobSpec) -> str:
    """The checkpoint claim's size: spec.syncer.checkpointStorage, else twice the estimate (head-room)."""
    if spec.syncer.checkpoint_storage is not None:
        return spec.syncer.checkpoint_storage
    estimate = checkpoint_bytes(spec)
    if estimate is None:  # name_problems refuses such a job before anything is rendered
        raise ValueError(STORAGE_NEEDED)
    return f"{max(1, math.ceil(2 * estimate / 2**30))}Gi"


STORAGE_NEEDED = ("spec.syncer.checkpointStorage: a model from spec.model.module has shapes only its code knows, "
                  "and one from spec.model.pretrained that leaves out its architecture only its config.json, "
                  "so the operator cannot size the syncer's checkpoint volume; set it (e.g. \"50Gi\": about "
                  "4 checkpoints x 8 bytes per parameter, twice over for head-room)")


def checkpoint_claim(owner: Owner, name: str, storage: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": meta(owner, name, n.SYNCER),
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}}}


def checkpoint_claims(spec: JobSpec, owner: Owner) -> list[dict[str, Any]]:
    """The syncer's volume, or one per shard under the names the StatefulSet's claim template
    would give them: made first by the operator, they carry the job's retention policy."""
    if spec.syncer.checkpoints is not None:  # in object storage: no volume at all
        return []
    storage = checkpoint_storage(spec)
    if spec.syncer.shards == 1:
        return [checkpoint_claim(owner, n.checkpoints(owner.name), storage)]
    return [checkpoint_claim(owner, n.shard_checkpoints(owner.name, i), storage) for i in range(spec.syncer.shards)]


def syncer_config_hash(job: DecoupledDiLoCoJob) -> str:
    return parts.digest(job.spec.syncer_inputs())


def _syncer_template(job: DecoupledDiLoCoJob, owner: Owner, shard: int | str | None) -> dict[str, Any]:
    """The syncer's pod template; `shard` is its --shard (None when unsharded; a number for a
    sharded syncer with a standby, whose pods carry it as the label `diloco.dev/shard` too)."""
    pod_security, container_security = parts.security()
    volumes, mounts = parts.common_volumes(owner, job.spec.syncer.token_secret or n.token_secret(owner.name))
    store = job.spec.syncer.checkpoints
    if store is None and shard is None:  # a sharded syncer's pods get theirs from the StatefulSet's claim template
        volumes.append({"name": n.CHECKPOINT_VOLUME,
                        "persistentVolumeClaim": {"claimName": n.checkpoints(owner.name)}})
    if store is None:
        mounts.append({"name": n.CHECKPOINT_VOLUME, "mountPath": n.CHECKPOINT_DIR})
    expose = job.spec.syncer.expose
    tls: dict[str, str] = {}
    if expose is not None and expose.tls.enabled and expose.tls.secret_name:
        volume, mount = parts.tls_volume(expose.tls.secret_name, (n.TLS_CERT_KEY, n.TLS_KEY_KEY))
        volumes.append(volume)
        mounts.append(mount)
        tls = {"tls_cert": f"{n.TLS_DIR}/{n.TLS_CERT_KEY}", "tls_key": f"{n.TLS_DIR}/{n.TLS_KEY_KEY}"}
    args = SyncerArgs(f"{n.CONFIG_DIR}/{n.CONFIG_KEY}", port=SYNCER_GRPC_PORT, metrics_port=SYNCER_METRICS_PORT,
                      checkpoint_dir=n.CHECKPOINT_DIR if store is None else store.url, token_file=n.TOKEN_FILE,
                      shard=shard, **tls)
    standby = job.spec.syncer.standby
    # With a standby, only the syncer holding the lease opens its gRPC port: readiness on it puts
    # that one pod behind the Service (learners follow a takeover there), while the standby lives
    # on its metrics port, which every syncer opens first.
    alive = "metrics" if standby is not None else "grpc"
    container = {
        "name": n.SYNCER,
        "image": job.spec.syncer.image,
        "command": container_command("syncer"),
        "args": args.argv(),
        "env": [{"name": "HOME", "value": "/tmp"}],
        # The store's credentials as the libraries read them (AWS_*, GOOGLE_APPLICATION_CREDENTIALS):
        # a named Secret's keys, or else the pod's own identity (spec.syncer.pod.serviceAccountName).
        **({"envFrom": [{"secretRef": {"name": store.secret_name}}]} if store and store.secret_name else {}),
        "ports": [{"name": "grpc", "containerPort": SYNCER_GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": SYNCER_METRICS_PORT, "protocol": "TCP"}],
        # Restoring a large checkpoint takes a while; only then does the port open.
        "startupProbe": {"tcpSocket": {"port": alive}, "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 5 if standby is None else 2},
        "livenessProbe": {"tcpSocket": {"port": alive}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": parts.resources(job.spec.syncer.resources),
        "securityContext": container_security,
        "volumeMounts": mounts,
    }
    shard_label = {n.SHARD: str(shard)} if isinstance(shard, int) else {}
    apart = apart_by_zone(owner, standby.zone_anti_affinity, shard if isinstance(shard, int) else None) \
        if standby is not None and not standby.elsewhere else None  # the other member is in another cluster
    return overlay.shape({
        "metadata": {"labels": {**n.labels(owner.name, n.SYNCER), **shard_label},
                     "annotations": {n.CONFIG_HASH: syncer_config_hash(job)}},
        "spec": {"containers": [container], "securityContext": pod_security,
                 "terminationGracePeriodSeconds": 60,  # the final checkpoint on SIGTERM
                 **parts.pod_basics(), "volumes": volumes,
                 **({"affinity": apart} if apart is not None else {})},
    }, job.spec.syncer.pod, job.spec.syncer.template)


def apart_by_zone(owner: Owner, rule: str, shard: int | None = None) -> dict[str, Any]:
    """The active syncer and its standby in different zones (topology.kubernetes.io/zone), so one
    zone's outage never takes both: required, or preferred where the cluster may have one zone.
    For a sharded syncer, each shard's pair apart (`shard`): the two pods of one shard avoid each
    other's zone, and other shards' pods may share it (N shards need 2 zones, not 2N)."""
    pods = n.selector(owner.name, n.SYNCER) if shard is None else n.shard_selector(owner.name, shard)
    term = {"labelSelector": {"matchLabels": pods}, "topologyKey": ZONE}
    if rule == "Required":
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def syncer_pod_template(job: DecoupledDiLoCoJob, owner: Owner) -> dict[str, Any]:
    """The syncer's pod template as its Deployment or StatefulSet runs it (Kueue's PodSet:
    operator/kueue/integration.py); a sharded standby's shards differ only in their --shard and
    shard label, and shard 0's stands for all."""
    if sharded_standby(job):
        return _syncer_template(job, owner, 0)
    return _syncer_template(job, owner, None if job.spec.syncer.shards == 1 else SHARD_FROM_HOSTNAME)


def syncer_workload(job: DecoupledDiLoCoJob, owner: Owner) -> dict[str, Any]:
    """One syncer: a Deployment. A sharded one: a StatefulSet, one pod per shard. (A sharded
    one with a standby is a Deployment per shard: `syncer_workloads`.)"""
    return syncer_deployment(job, owner) if job.spec.syncer.shards == 1 else syncer_statefulset(job, owner)


def syncer_workloads(job: DecoupledDiLoCoJob, owner: Owner) -> list[dict[str, Any]]:
    """What runs the syncer's pods: `syncer_workload`, or for a sharded syncer with a standby one
    Deployment per shard (`syncer_shard_deployment`)."""
    if sharded_standby(job):
        return [syncer_shard_deployment(job, owner, i) for i in range(job.spec.syncer.shards)]
    return [syncer_workload(job, owner)]


def syncer_services(job: DecoupledDiLoCoJob, owner: Owner) -> list[dict[str, Any]]:
    """Where learners dial the syncer: `syncer_service`, or for a sharded syncer with a standby
    one ClusterIP Service per shard (`syncer_shard_service`)."""
    if sharded_standby(job):
        return [syncer_shard_service(owner, i) for i in range(job.spec.syncer.shards)]
    return [syncer_service(owner, job.spec.syncer.shards)]


def syncer_deployment(job: DecoupledDiLoCoJob, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(owner, n.syncer(owner.name), n.SYNCER),
        "spec": {
            # With a standby (spec.syncer.standby) two pods, in two zones: the lease in the
            # checkpoint store says which one serves (syncer/durable/leader.py).
            "replicas": syncer_members(job),
            # One writer of the checkpoint volume, ever: the old pod stops before the new starts.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": n.selector(owner.name, n.SYNCER)},
            "template": _syncer_template(job, owner, None),
        },
    }


def syncer_shard_deployment(job: DecoupledDiLoCoJob, owner: Owner, shard: int) -> dict[str, Any]:
    """Shard `shard` of a sharded syncer with a standby (spec.syncer.standby): like the unsharded
    standby, two pods racing for the shard's lease in the store (`<url>/shard-<i>`), kept apart by
    zone, `--shard` given outright (a Deployment's pod names carry no ordinal). A StatefulSet of
    2N pods cannot say which two pods serve one shard; N Deployments can, each selecting its
    shard's pods by the label `diloco.dev/shard`."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _shard_meta(owner, shard),
        "spec": {
            "replicas": syncer_members(job),
            "strategy": {"type": "Recreate"},  # as the unsharded syncer's: old pods stop before new start
            "selector": {"matchLabels": n.shard_selector(owner.name, shard)},
            "template": _syncer_template(job, owner, shard),
        },
    }


def _shard_meta(owner: Owner, shard: int) -> dict[str, Any]:
    out = meta(owner, n.syncer_shard(owner.name, shard), n.SYNCER)
    return {**out, "labels": {**out["labels"], n.SHARD: str(shard)}}


def syncer_statefulset(job: DecoupledDiLoCoJob, owner: Owner) -> dict[str, Any]:
    """Shard i is pod <job>-syncer-i (its ordinal, read from the pod's hostname: every version
    has it), with its own checkpoint volume; a StatefulSet never runs two pods of one ordinal,
    so each volume has one writer. The operator makes the volumes beforehand (checkpoint_claims),
    under the names the claim template gives them, so they follow spec.runPolicy.checkpointRetention."""
    name = n.syncer(owner.name)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": meta(owner, name, n.SYNCER),
        "spec": {
            "replicas": job.spec.syncer.shards,
            "serviceName": name,
            "podManagementPolicy": "Parallel",  # shards never wait for each other
            "selector": {"matchLabels": n.selector(owner.name, n.SYNCER)},
            "template": _syncer_template(job, owner, SHARD_FROM_HOSTNAME),
            "volumeClaimTemplates": [] if job.spec.syncer.checkpoints is not None else [{
                "metadata": {"name": n.CHECKPOINT_VOLUME, "labels": n.labels(owner.name, n.SYNCER)},
                "spec": {"accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": checkpoint_storage(job.spec)}}},
            }],
        },
    }


def syncer_service(owner: Owner, shards: int = 1) -> dict[str, Any]:
    """A sharded syncer's is headless: learners dial each shard pod by its stable name."""
    headless = {"clusterIP": "None"} if shards > 1 else {}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(owner, n.syncer(owner.name), n.SYNCER),
            "spec": {**headless, "selector": n.selector(owner.name, n.SYNCER),
                     "ports": [{"name": "grpc", "port": SYNCER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                                "appProtocol": "grpc"},
                               {"name": "metrics", "port": SYNCER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]}}


def syncer_shard_service(owner: Owner, shard: int) -> dict[str, Any]:
    """Shard `shard`'s ClusterIP Service (a sharded syncer with a standby): it selects the shard's
    two pods, and only the lease holder is ready (its gRPC port is open), so
    `J-syncer-shard-<i>.<ns>.svc:50051` reaches whichever pod serves the shard now."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _shard_meta(owner, shard),
            "spec": {"selector": n.shard_selector(owner.name, shard),
                     "ports": [{"name": "grpc", "port": SYNCER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                                "appProtocol": "grpc"},
                               {"name": "metrics", "port": SYNCER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]}}
