"""The job's status (`.status`): what the operator writes, as pydantic models next to the spec.

The CRD's status schema is generated from these (operator/crd.py), so `kubectl explain
ddj.status` documents every field, and the API server, which prunes fields a structural schema
lacks, keeps exactly these. The operator checks every status it writes against `JobStatus`
(operator/status/job.py `validated`): a key missing here would be dropped by the server without a
word, so it fails there, in tests, instead. The operator itself works on the plain dicts (they
are merge patches); these models are the contract. Fields are absent until known and never
null, except `startTime`, which a merge patch clears with null when a job is suspended, and
`progress`, `eta` and `progressDetail`, cleared the same way when they stop meaning anything.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.json_schema import SkipJsonSchema

from diloco.spec.base import Model

Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0.0)]
Absent = SkipJsonSchema[None]  # may be left out; never written as null (so not nullable in the CRD)

Phase = Literal["Pending", "Running", "Suspended", "Succeeded", "Failed"]
ConditionStatus = Literal["True", "False", "Unknown"]
# pods.Loss reasons: a deletion, an eviction, a preemption (spot reclaims and node shutdowns too), a
# failed pod or container; Chaos and Rollout are restarts the operator caused (planned).
LossReason = Literal["Deleted", "Evicted", "Preempted", "Failed", "Chaos", "Rollout"]
# failures.py: pod states a restart cannot fix. Unschedulable is no longer one (a pod waiting for
# capacity is not failing: operator/failures/capacity.py); it stays so statuses written before still validate.
FailureReason = Literal["ImagePullFailed", "Unschedulable", "ConfigError", "TokenRefused"]
# metav1.Condition's own limits, so the condition list reads like any other object's.
CONDITION_TYPE = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$")
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
MAX_MESSAGE = 32768


class StatusModel(Model):
    """Accepts camelCase keys only: a snake_case key is one the API server would prune."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=False, validate_by_name=False,
                              validate_by_alias=True, extra="forbid", frozen=True)


class Condition(StatusModel):
    """A metav1.Condition (`kubectl wait --for=condition=<type>`). Its lastTransitionTime changes
    only when its status flips, so a status written every few seconds does not look like flapping."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE,
                      description="Created (children exist), Running (learners train with a ready syncer), "
                                  "Degraded (some desired learners not ready), Suspended (spec.suspend), "
                                  "PodsFailing (a pod fails in a way a restart cannot fix), PodsUnschedulable "
                                  "(a pod waits for capacity), ChildrenRefused (the API server refused a child: "
                                  "quota, webhook, RBAC), SpecRejected (an edit of an immutable field was "
                                  "refused), Admitted (queued in Kueue: admitted or waiting), Succeeded, Failed.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON,
                        description="Why, in one CamelCase word (e.g. LearnersTraining, TokenBudgetReached, "
                                    "InvalidSpec, BackoffLimitExceeded, ImagePullFailed, "
                                    "SchedulingTimeoutExceeded, QuotaExceeded, SecretMissing).")
    message: str = Field(max_length=MAX_MESSAGE, description="Details for people: what is wrong and the fix.")
    last_transition_time: AwareDatetime = Field(description="When the status last changed (RFC 3339, UTC).")
    observed_generation: Count | Absent = Field(None, description="metadata.generation this condition is about.")


class LearnerGroupStatus(StatusModel):
    """One learner group of this cluster's manifest; the counters are the operator's own memory
    (kept across operator restarts), so absent means 0."""

    name: str = Field(min_length=1, max_length=63, description="spec.learnerGroups[].name.")
    region: str | Absent = Field(None, description="spec.learnerGroups[].region.")
    desired: Count = Field(0, description="Learners that should run now: replicas, 0 when suspended or finished.")
    ready: Count = Field(0, description="Learners ready now (a multi-host learner: all its hosts).")
    lost: Count = Field(0, description="Learners lost so far (deleted, evicted, failed), preemptions not included.")
    preempted: Count = Field(0, description="Learners lost to preemption so far.")
    planned: Count = Field(0, description="Planned restarts so far (a chaos kill, a rollout of a new pod "
                                          "template): the operator's doing, not losses.")
    readmitted: Count = Field(0, description="Lost learners that came back and re-joined so far.")
    restarts: Count | Absent = Field(None, description="Multi-host groups only (hostsPerLearner > 1): whole-"
                                                       "learner restarts after a host was lost.")
    cluster: str | Absent = Field(None, description="A multi-cluster job's group that runs in a remote cluster "
                                                   "(spec.clusters): its counts are that cluster's operator's.")


class LostLearner(StatusModel):
    """A learner slot lost and not yet back; it counts once until a ready pod re-admits it."""

    slot: str = Field(min_length=1, description="The learner, `<group>-<index>`.")
    reason: LossReason = Field(description="Deleted, Evicted, Preempted or Failed; Chaos or Rollout for a "
                                           "planned restart.")
    pod: str = Field(description="uid of the pod that was lost.")
    since: AwareDatetime = Field(description="When the loss was seen (RFC 3339, UTC).")
    restart: str | Absent = Field(None, description="Multi-host learners: why it restarts as a whole (which "
                                                    "host was lost).")


class GangRun(StatusModel):
    """The processes of one multi-host learner's running program (operator/failures/gangs.py)."""

    learner: str = Field(min_length=1, description="The learner, `<group>-<index>`.")
    hosts: list[str] = Field(description="Per host, in order: `<pod uid>/<container restarts>`.")


class SyncerStatus(StatusModel):
    """The syncer as the operator sees it, with its own answers to the Status RPC once it gives them."""

    endpoint: str = Field(description="Where the operator and the learners dial it (host:port, one per shard).")
    ready: bool = Field(description="Its pods are ready (every shard's), or an external syncer answered.")
    restarts: Count = Field(description="Container restarts of its pods; more than spec.runPolicy.backoffLimit "
                                        "fail the job.")
    external: bool | Absent = Field(None, description="True: in another cluster (spec.syncer.external).")
    exposed_address: str | Absent = Field(None, description="Where other clusters dial it (spec.syncer.expose), "
                                                            "once known: host:port, or for a sharded syncer every "
                                                            "shard's (shard-<i>.<host>:port), comma-separated in "
                                                            "shard order, what their learners pass as --syncer.")
    incarnation: str | Absent = Field(None, description="Its process's id: a new one after each restart.")
    active_learners: Count | Absent = Field(None, description="Learners connected to it, in every cluster.")
    readmissions: Count | Absent = Field(None, description="Re-joins it saw: joins beyond each learner's first.")
    active: str | Absent = Field(None, description="With spec.syncer.standby: the pod that holds the syncer's lease "
                                                   "and serves; for a sharded syncer each shard's, comma-separated "
                                                   "in shard order.")
    lease_epoch: Count | Absent = Field(None, description="With spec.syncer.standby: the lease's epoch (one more at "
                                                          "every takeover or clean handover; for a sharded syncer "
                                                          "the sum of its shards').")
    takeovers: Count | Absent = Field(None, description="With spec.syncer.standby: times a standby took over from a "
                                                        "silent active syncer (every shard's).")
    lease_epochs: Annotated[list[Count], Field(max_length=64)] | Absent = Field(None, description="With spec.syncer.standby and "
                                               "spec.syncer.shards > 1: each shard's lease epoch, in shard order "
                                               "(leaseEpoch is their sum, active names each shard's holder).")


class RegionStatus(StatusModel):
    """One region as the syncer sees it, whichever cluster its learners run in."""

    region: str = Field(description="spec.learnerGroups[].region (or spec.syncer.remoteRegions).")
    learners: Count = Field(description="Learners of the region that joined.")
    active_learners: Count = Field(description="Of those, connected now.")
    tokens_merged: Count = Field(description="Tokens of its learners merged into the global model.")
    bytes_received: Count = Field(description="Bytes of outer gradients received from it.")
    contributions: Count = Field(description="Fragment contributions merged from it.")
    mean_staleness: float = Field(ge=0.0, description="Mean staleness of its contributions, in outer versions.")


class Accounting(StatusModel):
    """Goodput's and availability's running sums (so an operator restart continues them)."""

    desired_learner_seconds: Seconds = Field(description="Learner-seconds the spec asked for while running.")
    active_learner_seconds: Seconds = Field(description="Of those, learner-seconds the syncer saw connected.")
    down_learner_seconds: Seconds | Absent = Field(None, description="Of those, learner-seconds not connected.")
    group_seconds: dict[str, Seconds] | Absent = Field(None, description="Desired learner-seconds by group.")
    step_seconds: dict[str, Seconds] | Absent = Field(
        None, description="Each group's newest measured step time (its region's median), for its capacity.")
    useful_tokens: Count | Absent = Field(None, description="Tokens merged into the global model while counting "
                                                            "(this cluster's regions).")
    refused_pushes: Count | Absent = Field(None, description="Pushes refused for what they held (work thrown away).")
    last_tokens_merged: Count | Absent = Field(None, description="Tokens merged at the last sample.")
    last_refused: Count | Absent = Field(None, description="The syncer's refusal count at the last sample.")
    last_incarnation: str | Absent = Field(None, description="The syncer incarnation at the last sample.")
    sampled_at: float = Field(description="When the sums were last advanced (Unix seconds); a longer gap "
                                          "(the operator was down) is not counted.")


class Badput(StatusModel):
    """The capacity that did not become training in the model, by reason, as shares of it."""

    down: Annotated[float, Field(ge=0.0, le=1.0)] = Field(description="Desired learners not connected.")
    refused: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        description="Pushes refused (stale, out of bounds, outliers), one learner-step each (a lower bound).")
    other: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        description="The rest: starting and joining, work lost to kills, merges in flight, evaluations.")


class FailureEntry(StatusModel):
    """A pod failing in a way a restart cannot fix."""

    pod: str = Field(description="The pod's name.")
    who: str = Field(description="`learner <group>-<index>` or `syncer`.")
    reason: FailureReason = Field(description="ImagePullFailed, ConfigError or TokenRefused (Unschedulable: only "
                                              "from operators before waiting for capacity stopped counting).")
    message: str = Field(description="What is wrong.")


class LastFailure(FailureEntry):
    """The latest failure counted, kept after its pod is gone (the Failed ending quotes it)."""

    at: AwareDatetime = Field(description="When it was first seen (RFC 3339, UTC).")


class FailuresStatus(StatusModel):
    """Permanent pod failures (operator/failures/policy.py), each counted once against backoffLimit."""

    permanent: Count = Field(description="Counted so far; more than spec.runPolicy.backoffLimit fail the job.")
    failing_pods: Count = Field(description="Pods showing one now.")
    current: list[FailureEntry] = Field(max_length=10, description="The first 10 of those pods.")
    counted: list[str] = Field(max_length=1000, description="What was counted, `<pod uid>/<container or "
                                                            "scheduling>/<instance>` (of pods still present).")
    last: LastFailure | Absent = Field(None, description="The latest failure counted.")


class RemoteClusterStatus(StatusModel):
    """A remote cluster of a multi-cluster job (spec.clusters) and the health of its part there."""

    name: str = Field(min_length=1, max_length=63, description="spec.clusters[].name.")
    namespace: str = Field(min_length=1, max_length=63, description="Where its part lives there.")
    kubeconfig_secret: str = Field(min_length=1, max_length=253, description="The Secret the operator logs in with.")
    reachable: bool = Field(description="Its API server answered the last pass and the part is usable.")
    phase: str = Field("", max_length=32, description="Its part's phase, as that cluster's operator reports it "
                                                      "(the last known while unreachable).")
    learners: str = Field("", max_length=32, description="Its part's ready/desired learners (the last known while "
                                                         "unreachable).")
    message: str = Field("", max_length=MAX_MESSAGE, description="Why it is unreachable or its part not written.")
    last_transition_time: AwareDatetime = Field(description="When `reachable` last changed.")


class StartedSpec(StatusModel):
    """The immutable fields' values when the job started (operator/admission/immutable.py)."""

    uid: str = Field(description="metadata.uid of the job: a copy of the status on another object does not count.")
    fields: dict[str, Any] = Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
                                   description="spec path (managedBy, model, data, syncer.fragments, ...) -> its "
                                               "value then, defaults filled in.")


class ChaosStatus(StatusModel):
    """Where the seeded chaos schedule stands, so an operator restart neither repeats nor skips kills."""

    seed: int = Field(description="spec.chaos.seed the schedule started with.")
    mean_seconds_between_kills: float = Field(gt=0.0, description="spec.chaos.meanSecondsBetweenKills then.")
    since: float = Field(description="The schedule's origin (Unix seconds).")
    kills: Count = Field(description="Kills made so far.")


class ProgressSample(StatusModel):
    """The syncer's counters at one pass: the ETA's rate is measured from the oldest kept."""

    at: float = Field(description="When (Unix seconds).")
    outer_version: Count = Field(description="status.outerVersion then.")
    tokens_merged: Count = Field(description="status.tokensMerged then.")


class ProgressDetail(StatusModel):
    """The bound the Progress and ETA columns count toward (operator/status/progress.py)."""

    unit: Literal["tokens", "steps", "seconds"] = Field(
        description="tokens: spec.training.tokenBudget against tokensMerged; steps: spec.training.steps against the "
                    "slots merged (outerVersion / spec.syncer.shards, an estimate); seconds: "
                    "spec.training.durationSeconds since startTime. With several, the one expected first.")
    done: Count = Field(description="Units done so far.")
    bound: Annotated[int, Field(ge=1)] = Field(description="Units at which the job ends.")
    percent: Annotated[float, Field(ge=0.0, le=100.0)] = Field(
        description="done over bound; 100 only once the job succeeded.")
    rate: Annotated[float, Field(ge=0.0)] = Field(description="Units a second over the last ten minutes or so; 0 "
                                                              "while unknown or not running.")
    samples: list[ProgressSample] = Field(max_length=8, description="The rate's memory: counters a few minutes "
                                                                    "apart, emptied while the job does not run.")


class JobStatus(StatusModel):
    """What the operator observed: phase, conditions, learners, the syncer's view and goodput."""

    observed_generation: Count | Absent = Field(None, description="metadata.generation of the last spec handled.")
    phase: Phase | Absent = Field(None, description="Pending, Running, Suspended, Succeeded or Failed (from the "
                                                    "conditions).")
    conditions: list[Condition] | Absent = Field(
        None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="The job's conditions, one per type, in a stable order.")
    learners: Annotated[str, Field(pattern=r"^[0-9]+/[0-9]+$")] | Absent = Field(
        None, description="`<ready>/<desired>` learners (the Learners column).")
    desired_learners: Count | Absent = Field(None, description="Learners that should run now in this cluster.")
    ready_learners: Count | Absent = Field(None, description="Learners ready now in this cluster.")
    learner_groups: list[LearnerGroupStatus] | Absent = Field(None, description="Per group of this cluster's "
                                                                                "manifest.")
    lost_learners: list[LostLearner] | Absent = Field(None, description="Slots lost and not back yet.")
    gang_runs: list[GangRun] | Absent = Field(None, description="Multi-host learners' running programs.")
    syncer: SyncerStatus | Absent = Field(None, description="The syncer.")
    outer_version: Count | Absent = Field(None, description="Sum of the global fragments' versions (the Version "
                                                            "column); the last known while the syncer is silent.")
    tokens_merged: Count | Absent = Field(None, description="Tokens merged into the global model, every cluster's.")
    regions: list[RegionStatus] | Absent = Field(None, description="The syncer's view by region (every cluster).")
    accounting: Accounting | Absent = Field(None, description="Goodput's and availability's running sums.")
    goodput: Annotated[float, Field(ge=0.0, le=1.0)] | Absent = Field(
        None, description="Tokens merged into the global model over the tokens the desired learners could have "
                          "trained at their measured step rates, since the job started (the Goodput column).")
    availability: Annotated[float, Field(ge=0.0, le=1.0)] | Absent = Field(
        None, description="Desired learner-seconds the syncer saw connected over all desired learner-seconds "
                          "(connected is not productive: refused pushes count here, not in goodput).")
    badput: Badput | Absent = Field(None, description="Capacity lost, by reason (shares of capacity).")
    progress: Annotated[str, Field(pattern=r"^[0-9]{1,3}%$")] | None = Field(
        None, description="How far toward the job's bound, e.g. `41%` (the Progress column); absent without "
                          "tokenBudget, steps or durationSeconds.")
    eta: str | None = Field(None, description="About how long until the bound, at the rate of the last ten minutes "
                                              "or so, e.g. `2h13m` (the ETA column); absent while unknown or "
                                              "not running.")
    progress_detail: ProgressDetail | None = Field(None, description="The bound, how far, and the rate behind the "
                                                                     "ETA.")
    start_time: AwareDatetime | None = Field(None, description="When the job (last) started running; cleared on "
                                                               "suspend, so activeDeadlineSeconds restarts.")
    completion_time: AwareDatetime | Absent = Field(None, description="When it succeeded or failed.")
    failures: FailuresStatus | Absent = Field(None, description="Permanent pod failures; absent until the first.")
    started_spec: StartedSpec | Absent = Field(None, description="The immutable fields' values at the start.")
    chaos: ChaosStatus | Absent = Field(None, description="spec.chaos's schedule, when enabled.")
    clusters: list[RemoteClusterStatus] | Absent = Field(None, description="A multi-cluster job's remote clusters "
                                                                        "(spec.clusters) and their parts' health.")
