"""The `DecoupledDiLoCoJob` spec: one pydantic model for the operator, the CRD and `diloco run`.

Field names follow the custom resource (camelCase aliases) and the conventions of
Kubeflow's training jobs, JobSet and KubeRay (`suspend`, `runPolicy`, named groups).
Every default says why it is that value; cross-field rules live in `_check_job`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from diloco.contract import LearnerId
from diloco.spec import clusters as _clusters
from diloco.spec.base import ALTERNATES, DNS_LABEL, DNS_SUBDOMAIN, HOST_PORT, Model
from diloco.spec.clusters import KUBECONFIG_KEY, RemoteCluster, shard_hosts  # noqa: F401
from diloco.spec.copies import GroupData, copy_problems, group_data, path_field  # noqa: F401

# Re-exported: diloco.spec is the one place the job spec is imported from.
from diloco.spec.learner import PRESETS, CompilationCache, Data, DataSource, Mesh, Training, TransformerModel  # noqa: F401
from diloco.spec.pod import RESERVED_NAMES, RESERVED_PREFIXES, PodOverlay, PodTemplate, Resources, Toleration  # noqa: F401
from diloco.spec.status import (  # noqa: F401
    MAX_MESSAGE,
    Condition,
    JobStatus,
    LearnerGroupStatus,
    LostLearner,
    Phase,
    SyncerStatus,
)
from diloco.spec.syncer import (  # noqa: F401
    DEFAULT_SYNCER_IMAGE,
    Expose,
    ExposeTLS,
    ExternalSyncer,
    Gateway,
    GraceWindow,
    Staleness,
    Syncer,
)

API_VERSION: Final = "diloco.dev/v1alpha1"
KIND: Final = "DecoupledDiLoCoJob"
# spec.managedBy of jobs this operator runs (JobSet's and Kubeflow's convention); absent means us too.
MANAGED_BY = "diloco.dev/operator"
DEFAULT_IMAGE = "ghcr.io/decoupled-diloco/learner:0.1.0"


class LearnerGroup(Model):
    """One pool of learners, usually one region or one accelerator type."""

    name: str = Field(pattern=DNS_LABEL, max_length=40)
    region: str = "local"  # a label for status and metrics; one machine is one region
    replicas: int = Field(1, ge=0, le=4096)  # 0 keeps a group declared but idle (scale it up later)
    # The fewest learners this group may start with when queued in Kueue: its PodSet's minCount,
    # so Kueue may admit part of the group and the rest join later (operator/kueue/slices.py).
    # Unset: all `replicas` or none (Kueue's default). Without Kueue the group runs `replicas`.
    min_replicas: int | None = Field(None, ge=1, le=4096)
    image: str = DEFAULT_IMAGE
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    pod: PodOverlay | None = None  # labels, env, volumes, a service account ... (spec/pod.py)
    template: PodTemplate | None = None  # a pod template merged last: sidecars, affinity ... (spec/pod.py)
    # >1 stretches each step by this factor: a stand-in for older or slower chips.
    slowdown: float = Field(1.0, ge=1.0, le=100.0)
    # First data shard of this group's learners (learner i reads shard shardOffset + i). Unset:
    # right after the previous group's. Clusters of one job set it so their shards never overlap.
    shard_offset: int | None = Field(None, ge=0)
    # Hosts (processes, pods) per learner: a multi-host TPU slice or several GPU nodes run one
    # SPMD program (jax.distributed); the learner restarts as a whole when one host is lost.
    hosts_per_learner: int = Field(1, ge=1, le=1024)
    # This group's own copy of the data (its region's bucket): spec/copies.py; every copy must
    # hold the same files and sizes (checked by `diloco validate --inputs`, `diloco run` and the
    # syncer at Join).
    data: GroupData | None = None
    # The remote cluster (a name in spec.clusters) this group runs in; unset: this cluster.
    cluster: str | None = Field(None, pattern=DNS_LABEL, max_length=40)


ChaosTarget = Literal["learners", "syncer"]


class Chaos(Model):
    enabled: bool = False  # chaos is for testing self-healing, never on by accident
    mean_seconds_between_kills: float = Field(60.0, gt=0.0)  # several kills in a short demo run
    restart_delay_seconds: float = Field(5.0, ge=0.0)  # a StatefulSet's restart, roughly
    seed: int = 0  # the schedule is a pure function of it: same manifest, same kills
    max_concurrent: int = Field(1, ge=1)  # one target down at a time: each recovery is visible
    targets: list[ChaosTarget] = Field(default_factory=lambda: list[ChaosTarget](["learners"]))


# What happens to the checkpoint volume(s) when the job is deleted. Retain: they stay (no owner
# reference), so deleting a job never deletes the trained model; Delete: they go with the job.
CheckpointRetention = Literal["Retain", "Delete"]
# Which pods go when the job finishes, after Kubeflow's training operator. All: every pod. Running:
# those still running fine: the learners always (they hold the accelerators), the syncer when the job
# succeeded; a failed job keeps its syncer so its logs say why. None: every pod stays, still running.
CleanPodPolicy = Literal["None", "Running", "All"]


class RunPolicy(Model):
    # Unset: a job runs until its budget or steps. Counted from the job's start, time spent
    # waiting for capacity (Pending) included, as for a Kubernetes Job.
    active_deadline_seconds: int | None = Field(None, ge=1)
    ttl_seconds_after_finished: int | None = Field(None, ge=0)  # unset: finished jobs stay for inspection
    backoff_limit: int = Field(6, ge=0)  # Kubernetes Job's default
    # How long one of the job's pods may stay Unschedulable (waiting for capacity) before the job
    # ends Failed/SchedulingTimeoutExceeded. Unset: it waits for capacity forever, as JobSet and
    # Kubeflow Trainer jobs do; waiting never counts against backoffLimit (operator/failures/capacity.py).
    scheduling_timeout_seconds: int | None = Field(None, ge=1)
    # Retain: the checkpoint is the trained model, and a deleted job (kubectl delete, the TTL above)
    # must not take it along; read when the volume is created.
    checkpoint_retention: CheckpointRetention = "Retain"
    # Running, as Kubeflow's default: accelerators are freed the moment the job ends, and a failed
    # job's syncer (CPU only) stays for `kubectl logs` until the job is deleted.
    clean_pod_policy: CleanPodPolicy = "Running"


class JobSpec(Model):
    # Kueue and users pause a job by setting it: every pod goes (the syncer too, so a suspended job
    # holds no compute); checkpoint, config and token stay, and a resume continues from the checkpoint.
    suspend: bool = False
    # Which controller runs this job; another one's name (e.g. kueue.x-k8s.io/multikueue, whose
    # workers run the copies) makes this operator leave the job alone. Set it only at creation.
    managed_by: str | None = Field(None, pattern=r"^[a-z0-9.-]+/[a-z0-9._-]+$", max_length=63)
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    learner_groups: list[LearnerGroup] = Field(min_length=1)
    syncer: Syncer = Field(default_factory=Syncer)
    model: TransformerModel = Field(default_factory=TransformerModel)
    data: Data = Field(default_factory=Data)
    training: Training = Field(default_factory=Training)
    chaos: Chaos = Field(default_factory=Chaos)
    # Other clusters that run some of the groups (one job across regions: diloco/spec/clusters.py).
    clusters: list[RemoteCluster] = Field(default_factory=list, max_length=32)

    @property
    def total_learners(self) -> int:
        return sum(g.replicas for g in self.learner_groups)

    def learner_ids(self) -> list[LearnerId]:
        """Every learner of this manifest, group by group; `str()` of one is the StatefulSet
        pod name's suffix."""
        return [LearnerId(g.name, i) for g in self.learner_groups for i in range(g.replicas)]

    def data_for(self, group: str) -> Data:
        """spec.data as learners of `group` read it: their copy's paths (spec/copies.py), the one
        place every reader of a group's data path asks."""
        return group_data(self.data, next(g for g in self.learner_groups if g.name == group))

    @property
    def shard_count(self) -> int:
        return self.data.shards or max(self.total_learners, 1)

    def shard_offsets(self) -> list[int]:
        """Each group's first shard: its own shardOffset, else right after the previous group."""
        out, next_free = [], 0
        for g in self.learner_groups:
            offset = g.shard_offset if g.shard_offset is not None else next_free
            out.append(offset)
            next_free = offset + g.replicas
        return out

    def shard_of(self, group: str, index: int) -> tuple[int, int]:
        """(shard, shard count) of learner `group-index`. A scavenger past its group's replicas
        has no shard of its own: it gets count + index, which the learner wraps into range."""
        names = [g.name for g in self.learner_groups]
        g = names.index(group)
        inside = index < self.learner_groups[g].replicas
        return (self.shard_offsets()[g] + index if inside else self.shard_count + index), self.shard_count

    def learner_inputs(self, group: str) -> dict[str, Any]:
        """What a learner of `group` reads at start (its pod restarts when this changes). Scaling,
        chaos and other groups are not in it: a scale-up must not restart running learners."""
        g = next(x for x in self.learner_groups if x.name == group)
        s = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return {"model": s["model"], "data": s["data"], "training": s["training"],
                "syncer": {k: s["syncer"][k] for k in Syncer.READ_BY_LEARNERS},
                "group": g.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"replicas", "min_replicas"})}

    def syncer_inputs(self) -> dict[str, Any]:
        """What the syncer reads at start (its pod restarts when this changes): the batch size
        too, which bounds the tokens a push may report."""
        s = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        syncer = {k: v for k, v in s["syncer"].items() if k not in Syncer.NOT_READ_BY_SYNCER}
        return {"model": s["model"], "data": s["data"], "syncer": syncer,
                "training": {"batchSize": s["training"]["batchSize"]}}

    @property
    def tokens_per_step(self) -> int:
        """What one inner step of one learner trains: batchSize sequences of context tokens."""
        return self.training.batch_size * self.model.context

    def runs_here(self) -> bool:
        """Whether this operator runs the job (spec.managedBy absent or naming this operator)."""
        return self.managed_by in (None, MANAGED_BY)

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        derived = derived_decay_steps(self)
        if derived is not None and "decay_steps" not in self.training.model_fields_set:
            # Frozen: the one write, while the model is still being built.
            object.__setattr__(self, "training", self.training.model_copy(update={"decay_steps": derived}))
        problems = list(_cross_field_problems(self))
        if problems:
            raise ValueError("\n".join(problems))
        return self


def derived_decay_steps(spec: JobSpec) -> int | None:
    """spec.training.decaySteps where a manifest leaves it out. The learning rate's position is
    the job's trained tokens over M learners' batch (core/schedule.py JobProgress), so
    tokenBudget / (M x batchSize x context) ends the cosine exactly with the budget; a job
    stopped by step count ends it at its last slot. Never before the warmup ends (a budget too
    small to finish warming up then never decays). None: the default stands."""
    tr = spec.training
    if tr.token_budget is not None:
        steps = math.ceil(tr.token_budget / (spec.shard_count * tr.batch_size * spec.model.context))
    elif tr.steps is not None:
        steps = tr.steps
    else:
        return None
    return max(steps, tr.warmup_steps + 1)


class ObjectMeta(Model):
    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)

    name: str = Field(pattern=DNS_LABEL, max_length=50)
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class DecoupledDiLoCoJob(Model):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    api_version: Literal["diloco.dev/v1alpha1"] = API_VERSION
    kind: Literal["DecoupledDiLoCoJob"] = KIND
    metadata: ObjectMeta
    spec: JobSpec
    status: dict[str, Any] | None = None


def _cross_field_problems(spec: JobSpec) -> Iterable[str]:
    """Rules that span fields; each message starts with the field path it is about."""
    names = [g.name for g in spec.learner_groups]
    for name in sorted({n for n in names if names.count(n) > 1}):
        yield f"spec.learnerGroups: group name {name!r} is used twice; names must be unique"
    for i, g in enumerate(spec.learner_groups):
        if g.min_replicas is not None and g.min_replicas > g.replicas:
            yield (f"spec.learnerGroups[{i}].minReplicas: {g.min_replicas} exceeds replicas ({g.replicas}); "
                   "lower it or raise replicas")
        if g.min_replicas is not None and g.hosts_per_learner > 1:
            yield (f"spec.learnerGroups[{i}].minReplicas: Kueue admits part of a PodSet pod by pod, which could "
                   f"split a learner of {g.hosts_per_learner} hosts; remove minReplicas from multi-host groups")
    total = spec.total_learners
    # A learners-only cluster's quorum is not used; a home cluster's counts every cluster's learners.
    learners, where = max((total, "spec.learnerGroups"), (spec.data.shards or 0, "spec.data.shards"))
    if spec.syncer.external is None and spec.syncer.quorum > max(learners, 1):
        yield (
            f"spec.syncer.quorum: {spec.syncer.quorum} exceeds the {learners} learners in "
            f"{where}; lower the quorum or add replicas"
        )
    ext = spec.syncer.external
    if ext is not None and len(ext.addresses) != spec.syncer.shards:
        yield (f"spec.syncer.external.endpoints: {len(ext.addresses)} address(es) for a syncer of "
               f"{spec.syncer.shards} shard(s) (spec.syncer.shards); name one host:port per shard, in shard order")
    if spec.chaos.enabled and spec.chaos.max_concurrent >= max(total, 1) and total > 1:
        yield (
            f"spec.chaos.maxConcurrent: {spec.chaos.max_concurrent} would allow killing all "
            f"{total} learners at once; use at most {total - 1}"
        )
    if spec.training.warmup_steps >= spec.training.decay_steps:
        yield (
            f"spec.training.warmupSteps: {spec.training.warmup_steps} must be below "
            f"spec.training.decaySteps ({spec.training.decay_steps})"
        )
    yield from _shard_problems(spec)
    yield from _syncer_problems(spec)
    yield from _clusters.cluster_problems(spec.clusters, spec.learner_groups, external=spec.syncer.external is not None,
                                          exposed=spec.syncer.expose is not None,
                                          standby=spec.syncer.standby.cluster if spec.syncer.standby else None)
    yield from copy_problems(spec.data, spec.learner_groups)


def _shard_problems(spec: JobSpec) -> Iterable[str]:
    """Each learner reads its own slice of the data, in this manifest and across clusters."""
    groups, shards = spec.learner_groups, spec.data.shards
    if shards is None:
        for i, g in enumerate(groups):
            if g.shard_offset is not None:
                yield (f"spec.learnerGroups[{i}].shardOffset: needs spec.data.shards; set it to the number "
                       "of learners across all clusters")
        return
    ranges = [(off, off + g.replicas) for off, g in zip(spec.shard_offsets(), groups, strict=True)]
    for i, (g, (start, end)) in enumerate(zip(groups, ranges, strict=True)):
        if end > shards:
            yield (f"spec.learnerGroups[{i}].shardOffset: shards {start}..{end - 1} of group {g.name!r} "
                   f"exceed spec.data.shards ({shards}); raise spec.data.shards or lower shardOffset")
        for j in range(i):
            other = ranges[j]
            if start < other[1] and other[0] < end:
                yield (f"spec.learnerGroups[{i}].shardOffset: shards {start}..{end - 1} of group {g.name!r} "
                       f"overlap group {groups[j].name!r} ({other[0]}..{other[1] - 1}); give each group "
                       "its own range")


def _syncer_problems(spec: JobSpec) -> Iterable[str]:
    ext, expose = spec.syncer.external, spec.syncer.expose
    if ext is not None:
        if expose is not None:
            yield ("spec.syncer.expose: the syncer is external (spec.syncer.external), so there is none "
                   "here to expose; remove one of the two")
            return
        if spec.data.shards is None:
            yield ("spec.data.shards: a cluster that only hosts learners must say how many shards the whole "
                   "job has, or its learners would read other clusters' data; set it in every cluster")
        for i, g in enumerate(spec.learner_groups):
            if g.shard_offset is None and spec.data.shards is not None:
                yield (f"spec.learnerGroups[{i}].shardOffset: a cluster that only hosts learners must place "
                       "its groups' shards; set it past the shards the other clusters use")
    if expose is None:
        return
    if expose.tls.enabled and expose.tls.secret_name is None:
        yield ("spec.syncer.expose.tls.secretName: TLS is on when the syncer is exposed; name a "
               "kubernetes.io/tls Secret holding tls.crt, tls.key and ca.crt, or set "
               "spec.syncer.expose.tls.enabled: false")
    if expose.type == "GRPCRoute" and expose.gateway is None:
        yield ("spec.syncer.expose.gateway: a GRPCRoute needs the Gateway it attaches to; set "
               "spec.syncer.expose.gateway.name")
    if expose.type != "GRPCRoute" and expose.gateway is not None:
        yield "spec.syncer.expose.gateway: only used with type GRPCRoute; remove it or change the type"
    if spec.syncer.shards > 1 and expose.host is None:
        yield ("spec.syncer.expose.host: a sharded syncer is exposed as shard-<i>.<host>, one name per shard "
               "(its certificate, or the Gateway listener's, carries *.<host> or each name); set host")
    if expose.type != "LoadBalancer" and expose.load_balancer_source_ranges:
        yield ("spec.syncer.expose.loadBalancerSourceRanges: only used with type LoadBalancer; remove it "
               "or restrict access at the Gateway")


def home_view(spec: JobSpec) -> JobSpec:
    """What the home cluster of a multi-cluster job runs (diloco/spec/clusters.py); a one-cluster job as it is."""
    if not spec.clusters:
        return spec
    return JobSpec.model_validate(_clusters.home_part(_pinned(spec)))


def remote_spec(spec: JobSpec, cluster: str, *, endpoints: list[str], token_secret: str,
                server_name: str | None = None) -> JobSpec:
    """What remote cluster `cluster` runs: a learners-only job (diloco/spec/clusters.py)."""
    return JobSpec.model_validate(_clusters.remote_part(_pinned(spec), cluster, endpoints=endpoints,
                                                        token_secret=token_secret, server_name=server_name))


def _pinned(spec: JobSpec) -> dict[str, Any]:
    raw = spec.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=True)
    return _clusters.pinned(raw, spec.shard_count, spec.shard_offsets())


class SpecError(ValueError):
    """A manifest that does not validate; `problems` holds one `path: message` line each."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


_PATTERNS = {
    DNS_LABEL: "is not a DNS label (lower-case letters, digits and '-')",
    DNS_SUBDOMAIN: "is not a DNS name (lower-case letters, digits, '-' and '.')",
    HOST_PORT: "is not host:port (e.g. syncer.example.com:50051)",
    ALTERNATES: "is not host:port, nor host:port|host:port (a shard's syncer and its standby in another cluster)",
}


def _format_error(err: dict[str, Any]) -> list[str]:
    path = ""
    for part in err["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not str(part).startswith("function-"):
            path += f".{part}" if path else str(part)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and msg.startswith("spec."):
        return msg.split("\n")  # cross-field problems already name their paths
    if err["type"] == "extra_forbidden":
        msg = "unknown field; check its spelling (fields are camelCase)"
    elif err["type"] == "string_pattern_mismatch" and err["ctx"]["pattern"] in _PATTERNS:
        msg = f"{err['input']!r} {_PATTERNS[err['ctx']['pattern']]}"
    return [f"{path}: {msg}" if path else msg]


def parse_job(manifest: Any) -> DecoupledDiLoCoJob:
    """Validate a manifest (already parsed YAML/JSON); raise SpecError with every problem."""
    if not isinstance(manifest, dict):
        raise SpecError([f"manifest: expected a mapping, got {type(manifest).__name__}"])
    try:
        return DecoupledDiLoCoJob.model_validate(manifest)
    except ValidationError as exc:
        problems: list[str] = []
        for err in exc.errors(include_url=False):
            problems.extend(_format_error(dict(err)))
        raise SpecError(problems) from None


def load_job(path: str) -> DecoupledDiLoCoJob:
    """Read and validate a YAML manifest from disk."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            docs = [d for d in yaml.safe_load_all(fh) if d is not None]
    except OSError as exc:
        raise SpecError([f"{path}: cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"{path}: not valid YAML: {exc}"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from None
    if len(docs) != 1:
        raise SpecError([f"{path}: expected exactly one YAML document, found {len(docs)}"])
    return parse_job(docs[0])


def dump_job(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    """The manifest as plain data with camelCase keys (what a ConfigMap carries). A pretrained
    model keeps only the fields its manifest set: the rest come from its config.json where the
    directory can be read (diloco/hf.py `resolve`), not from our defaults."""
    out = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    if job.spec.model.pretrained is not None:
        out["spec"]["model"] = job.spec.model.model_dump(mode="json", by_alias=True, exclude_none=True,
                                                         exclude_unset=True)
    return out
