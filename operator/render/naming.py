"""Names, labels and owner references of a job's children, in one place.

Render, handlers, chaos and the pod bookkeeping all find children by these labels, so a
change here changes every selector at once. Label keys follow the Kubernetes recommended
labels plus `diloco.dev/*` for the job, component and group that selectors need.
"""

from __future__ import annotations

from typing import Any

from diloco.contract import COORDINATOR_PORT, SYNCER_GRPC_PORT, LearnerId
from diloco.spec import API_VERSION, KIND

MANAGER = "diloco-operator"  # field manager for server-side apply and the managed-by label
JOB = "diloco.dev/job"
COMPONENT = "diloco.dev/component"
GROUP = "diloco.dev/group"
INDEX = "apps.kubernetes.io/pod-index"  # set on every StatefulSet pod by the controller (1.28+)
POD_NAME = "statefulset.kubernetes.io/pod-name"  # likewise, on every Kubernetes version: the pod's own name
APPLIED_HASH = "diloco.dev/applied-hash"  # hash of what the operator last applied
CONFIG_HASH = "diloco.dev/config-hash"  # on pod templates: restart pods when training config changes
CHAOS = "diloco.dev/chaos-kill"  # annotation on a pod deleted by chaos (seen in its DELETED event)
# A multi-host learner's pods (hostsPerLearner > 1): the name of its own StatefulSet, and its
# index (their pod-index label is then the host: the process id within the learner).
GANG = "diloco.dev/gang"
LEARNER_INDEX = "diloco.dev/learner-index"
# A sharded syncer's pods with a standby (spec.syncer.standby): the shard they serve, which
# their Deployment, their Service and their zone anti-affinity select.
SHARD = "diloco.dev/shard"

LEARNER, SYNCER = "learner", "syncer"
CONFIG_KEY = "job.yaml"
TOKEN_KEY = "token"
CA_KEY = "ca.crt"  # the CA that signed the syncer's certificate (cert-manager's key name)
TLS_CERT_KEY, TLS_KEY_KEY = "tls.crt", "tls.key"  # a kubernetes.io/tls Secret's keys
CONFIG_DIR = "/etc/diloco"
TLS_DIR = "/etc/diloco-tls"  # beside, not inside, the read-only config mount
TOKEN_DIR = "/etc/diloco-token"  # the job token as a file (--token-file), never in the environment
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
CHECKPOINT_VOLUME = "checkpoints"  # the syncer's volume, and a sharded syncer's claim template name
CHECKPOINT_DIR = "/var/lib/diloco/checkpoints"
# A StatefulSet's pods carry `controller-revision-hash: <name>-<10 chars>`, a 63-character label.
MAX_STATEFULSET_NAME = 52


MAX_SERVICE_NAME = 63  # a Service's name is a DNS label (RFC 1035)


def service_name_problems(job: str, longest: str, what: str, why: str) -> list[str]:
    """A child Service's longest name (`longest`, the job's name plus a suffix) that Kubernetes would
    refuse, told with how long the job's name may be: `what` the Service is, `why` it exists."""
    if len(longest) <= MAX_SERVICE_NAME:
        return []
    room = MAX_SERVICE_NAME - (len(longest) - len(job))
    return [f"metadata.name: {what} {longest!r} has {len(longest)} characters, over {MAX_SERVICE_NAME}; with {why} "
            f"the job's name must stay within {room}"]


def statefulset(job: str, group: str) -> str:
    return f"{job}-{group}"


def gang(job: str, group: str, index: int) -> str:
    """The StatefulSet of learner `group-index` when it spans several hosts; its pods are `<gang>-<host>`."""
    return f"{job}-{group}-{index}"


def gang_selector(job: str, group: str, index: int) -> dict[str, str]:
    return {**selector(job, LEARNER, group), LEARNER_INDEX: str(index)}


def host_address(job: str, group: str, index: int, *, host: int, namespace: str) -> str:
    """A multi-host learner's host by its stable name under the group's headless Service."""
    return f"{gang(job, group, index)}-{host}.{statefulset(job, group)}.{namespace}.svc"


def coordinator_address(job: str, group: str, index: int, namespace: str) -> str:
    """jax.distributed's coordinator: host 0 of the learner."""
    return f"{host_address(job, group, index, host=0, namespace=namespace)}:{COORDINATOR_PORT}"


def syncer(job: str) -> str:
    return f"{job}-syncer"


def exposed_syncer(job: str, shard: int | None = None) -> str:
    """The LoadBalancer Service (or GRPCRoute) that other clusters' learners dial; with `shard`,
    that shard's own LoadBalancer Service (a sharded syncer is exposed shard by shard)."""
    return f"{job}-syncer-exposed" if shard is None else f"{job}-syncer-exposed-{shard}"


def exposed_syncers(job: str, shards: int) -> list[str]:
    """Every exposing object's name: one, or one per shard in shard order."""
    return [exposed_syncer(job)] if shards == 1 else [exposed_syncer(job, i) for i in range(shards)]


def syncer_shard_pod(job: str, shard: int) -> str:
    """Shard `shard`'s pod: the syncer StatefulSet's pod of that ordinal."""
    return f"{syncer(job)}-{shard}"


def syncer_shard(job: str, shard: int) -> str:
    """A sharded syncer's shard `shard` with a standby (spec.syncer.standby): its Deployment (the
    active pod and its standby) and its ClusterIP Service, which follows the shard's lease
    holder. `-shard-<i>`, never `-<i>`: `J-syncer-<i>` is the StatefulSet's pod of a sharded
    syncer without one."""
    return f"{syncer(job)}-shard-{shard}"


def shard_of_syncer(job: str, name: str) -> int | None:
    """The shard whose Deployment (or Service) is `name` (`syncer_shard`); None for any other name."""
    prefix = f"{syncer(job)}-shard-"
    raw = name[len(prefix):] if name.startswith(prefix) else ""
    return int(raw) if raw.isdigit() else None


def shard_selector(job: str, shard: int) -> dict[str, str]:
    """The pods of one shard of a sharded syncer with a standby."""
    return {**selector(job, SYNCER), SHARD: str(shard)}


def token_secret(job: str) -> str:
    return f"{job}-token"


def config_map(job: str) -> str:
    return f"{job}-config"


def checkpoints(job: str) -> str:
    return f"{job}-checkpoints"


def shard_checkpoints(job: str, shard: int) -> str:
    """Shard `shard`'s claim: the name the StatefulSet controller gives its claim template's
    volume for that pod (`<template>-<statefulset>-<ordinal>`), so it adopts one made beforehand."""
    return f"{CHECKPOINT_VOLUME}-{syncer(job)}-{shard}"


def syncer_policy(job: str) -> str:
    """The NetworkPolicy and the PodDisruptionBudget of the job's syncer pods."""
    return syncer(job)


def syncer_address(job: str, namespace: str) -> str:
    return f"{syncer(job)}.{namespace}.svc:{SYNCER_GRPC_PORT}"


def syncer_addresses(job: str, namespace: str, shards: int, *, standby: bool = False) -> str:
    """What learners pass as --syncer: the Service, or for a sharded syncer each shard pod's
    stable name under the headless Service, in shard (ordinal) order; with a standby, each
    shard's own Service (`syncer_shard`), which follows whichever pod holds that shard's lease."""
    if shards == 1:
        return syncer_address(job, namespace)
    if standby:
        return ",".join(f"{syncer_shard(job, i)}.{namespace}.svc:{SYNCER_GRPC_PORT}" for i in range(shards))
    return ",".join(f"{syncer_shard_pod(job, i)}.{syncer(job)}.{namespace}.svc:{SYNCER_GRPC_PORT}"
                    for i in range(shards))


def labels(job: str, component: str | None = None, group: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "decoupled-diloco",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/managed-by": MANAGER,
        JOB: job,
    }
    if component:
        out["app.kubernetes.io/component"] = component
        out[COMPONENT] = component
    if group:
        out[GROUP] = group
    return out


def selector(job: str, component: str | None = None, group: str | None = None) -> dict[str, str]:
    """The minimal, immutable subset used in StatefulSet/Deployment/Service selectors."""
    out = {JOB: job}
    if component:
        out[COMPONENT] = component
    if group:
        out[GROUP] = group
    return out


def owner_reference(job_name: str, uid: str) -> dict[str, Any]:
    """Children are garbage-collected with the job; `controller` marks the operator as their owner."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job_name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def job_reference(name: str, namespace: str, uid: str) -> dict[str, Any]:
    """Enough of the job's body for kopf to post Events about it from any handler."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": uid}}


def learner_of(pod: dict[str, Any]) -> tuple[str, LearnerId] | None:
    """(job, learner) of a learner pod, from its labels or its StatefulSet name suffix (a
    multi-host learner's pods carry their learner's index in a label of their own)."""
    meta = pod.get("metadata", {})
    lab = meta.get("labels") or {}
    job, group = lab.get(JOB), lab.get(GROUP)
    if not job or not group or lab.get(COMPONENT) != LEARNER:
        return None
    raw = lab.get(LEARNER_INDEX) or lab.get(INDEX) or meta.get("name", "").rsplit("-", 1)[-1]
    return (job, LearnerId(group, int(raw))) if raw.isdigit() else None


def host_of(pod: dict[str, Any]) -> int | None:
    """The host (process id) of a multi-host learner's pod: its StatefulSet ordinal."""
    meta = pod.get("metadata", {})
    raw = (meta.get("labels") or {}).get(INDEX) or meta.get("name", "").rsplit("-", 1)[-1]
    return int(raw) if raw.isdigit() else None
