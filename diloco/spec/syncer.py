"""How the syncer merges and publishes, and where it runs (`spec.syncer`). Part of the one job
spec (diloco/spec/__init__.py re-exports these classes).

The defaults are the paper's protocol as measured here (docs/ALGORITHM.md, docs/BENCHMARKS.md):
K = 1, a grace window, RDA over int4 outer gradients, int4 broadcast deltas, one shard.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from diloco.contract import SYNCER_GRPC_PORT
from diloco.core.choices import Adoption, Codec, MergeMethod  # names only: no numba on the spec's import
from diloco.core.fragments import Method
from diloco.core.rounds import StalePolicy
from diloco.spec.base import ALTERNATES, DNS_LABEL, DNS_SUBDOMAIN, HOST_PORT, Model
from diloco.spec.pod import PodOverlay, PodTemplate, Resources

DEFAULT_SYNCER_IMAGE = "ghcr.io/decoupled-diloco/syncer:0.1.0"


class GraceWindow(Model):
    """ξ_grace = clamp(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, cap) (docs/ALGORITHM.md, "The syncer")."""

    gamma: float = Field(0.8, ge=0.0, le=1.0)  # paper's γ: keep a safety margin of 20%
    tau: int = Field(2, ge=1, le=64)  # steps a fragment may be in flight before it is late
    # Cap on the wait. None: τ step times, so only the formula bounds it (at most γ·τ = 1.6 steps).
    # The paper caps at about one step; measured here, learners whose phases spread close to a
    # step then keep arriving just after the cap and skip slots (83 of 1,200 in a replay, +4.5%
    # loss; docs/BENCHMARKS.md, "The grace window's cap"). Learners never wait on it either way.
    cap_seconds: float | None = Field(None, ge=0.0)


class Staleness(Model):
    # Versions a contribution may lag the global fragment; 2 matches τ = 2 steps in flight.
    max_versions: int = Field(2, ge=0, le=64)
    # accept: merge a lagging outer gradient whole (learners rebase, so it holds only progress
    # Θ lacks); downweight: merge 1/(1 + lag) of it; drop: refuse any lag (its learner keeps the
    # progress and pushes it again at its next slot).
    policy: StalePolicy = "accept"


class ExternalSyncer(Model):
    """A syncer in another cluster (multi-cluster jobs); this cluster then hosts only learners."""

    # host:port of an unsharded syncer; or `endpoints`, one per shard in shard order (what the
    # home operator writes for a sharded one: docs/MULTI_CLUSTER.md). Exactly one of the two.
    # A shard whose standby runs in another cluster (spec.syncer.standby.cluster) is named by
    # both members, `host:port|host:port`: learners try the other while one is unreachable.
    endpoint: str | None = Field(None, pattern=ALTERNATES, max_length=523)
    endpoints: list[Annotated[str, Field(pattern=ALTERNATES, max_length=523)]] = Field(
        default_factory=list, max_length=64)
    # A Secret in the job's namespace: key `token` holds a copy of the home job's `<job>-token`;
    # an optional key `ca.crt`, the CA of the syncer's certificate, turns TLS on.
    token_secret: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    # The name in the syncer's certificate, when the endpoint's host is another (an IP, an alias).
    server_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)

    @model_validator(mode="after")
    def _one_way_to_name_it(self) -> ExternalSyncer:
        if (self.endpoint is None) == (not self.endpoints):
            raise ValueError("spec.syncer.external: name the syncer by `endpoint` (one shard) or by `endpoints` "
                             "(one host:port per shard, in shard order), exactly one of the two")
        return self

    @property
    def addresses(self) -> list[str]:
        """Every shard's host:port, in shard order (learners' --syncer, comma-joined)."""
        return [self.endpoint] if self.endpoint is not None else list(self.endpoints)


class Gateway(Model):
    """The Gateway API Gateway (and listener) a GRPCRoute attaches to."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    namespace: str | None = Field(None, pattern=DNS_LABEL, max_length=63)  # default: the job's
    section_name: str | None = Field(None, pattern=DNS_LABEL, max_length=63)
    # The listener's port, which other clusters' learners dial (the exposed address's port):
    # 443, an HTTPS listener's usual one.
    port: int = Field(443, ge=1, le=65535)


class ExposeTLS(Model):
    """The syncer's own TLS: on by default once it is reachable from outside the cluster."""

    enabled: bool = True
    # A kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt (what cert-manager writes).
    secret_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)


class Expose(Model):
    """Make an in-cluster syncer reachable from other clusters' learners."""

    type: Literal["LoadBalancer", "GRPCRoute"] = "LoadBalancer"
    # The DNS name remote learners dial; also the name the syncer's certificate is checked for.
    host: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    annotations: dict[str, str] = Field(default_factory=dict)  # on the Service or the GRPCRoute
    load_balancer_source_ranges: list[str] = Field(default_factory=list, max_length=64)  # CIDRs
    gateway: Gateway | None = None  # GRPCRoute only
    tls: ExposeTLS = Field(default_factory=ExposeTLS)

    @property
    def port(self) -> int:
        """The port other clusters dial: a GRPCRoute's Gateway listener's, else the syncer's own."""
        return self.gateway.port if self.type == "GRPCRoute" and self.gateway is not None else SYNCER_GRPC_PORT


class CheckpointLocation(Model):
    """Checkpoints in object storage instead of the syncer's volume (docs/CHECKPOINTS.md, "Object
    storage"): any zone, or another cluster, can restore them."""

    # An fsspec URL: s3://bucket/prefix, gs://bucket/prefix (the syncer image needs the `cloud`
    # extra's s3fs or gcsfs), or any other scheme whose fsspec package the image holds. A sharded
    # syncer keeps shard i under <url>/shard-<i>.
    url: str = Field(pattern=r"^[a-z][a-z0-9+.-]*://[^\s]+$", max_length=1024)
    # A Secret in the job's namespace whose keys become the syncer's environment, as the
    # libraries read it (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an
    # S3-compatible store; GOOGLE_APPLICATION_CREDENTIALS naming a mounted key file). Unset: the
    # pod's own identity (Workload Identity, IRSA: spec.syncer.pod.serviceAccountName), as for data.
    secret_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)


class Standby(Model):
    """A second syncer (per shard) that follows the active one's checkpoints in the store and
    takes over when the active one stops renewing its lease there (docs/OPERATIONS.md, SyncerDown)."""

    # The active syncer renews its lease in the store every third of this; a standby that sees
    # no renewal for this long takes over, and an active syncer that could not renew for this
    # long stops publishing. Shorter: faster takeovers, more store requests (3 a lease period).
    lease_seconds: float = Field(10.0, ge=2.0, le=600.0)
    # The standby's pods avoid the active's zone (topology.kubernetes.io/zone): Required keeps
    # a zone outage from taking both (a one-zone cluster leaves the standby Pending); Preferred
    # schedules it anyway.
    zone_anti_affinity: Literal["Required", "Preferred"] = "Required"
    # A home job of several clusters (spec.clusters): the standby runs in this one of them, one
    # syncer a shard there and one here, instead of two here, so the job survives the home
    # cluster's loss. Both need the store (spec.syncer.checkpoints) and the certificate.
    cluster: str | None = Field(None, pattern=DNS_LABEL, max_length=40)
    # With `cluster`: where every other cluster dials the standby (shard-<i>.<host> when sharded),
    # exposed there as spec.syncer.expose says for the home syncer.
    host: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    # The other member of each shard's pair when it runs in another cluster: one host:port per
    # shard, in shard order. The home operator writes it into each cluster's part (from `cluster`
    # and `host`); one syncer a shard then runs here, and learners dial both.
    peers: list[Annotated[str, Field(pattern=HOST_PORT, max_length=261)]] = Field(default_factory=list,
                                                                                  max_length=64)

    @property
    def elsewhere(self) -> bool:
        """The pair's other member runs in another cluster: one syncer a shard here."""
        return self.cluster is not None or bool(self.peers)


class Syncer(Model):
    # The learner plans fragments and adopts published ones; codec and block size reach it at Join.
    READ_BY_LEARNERS: ClassVar[tuple[str, ...]] = ("fragments", "fragmentation", "shards", "adoption")
    # Pod settings, and exposure (its TLS files show in the syncer's pod template itself).
    NOT_READ_BY_SYNCER: ClassVar[tuple[str, ...]] = ("image", "resources", "expose", "checkpoint_storage",
                                                     "token_secret")

    quorum: int = Field(1, ge=1)  # K = 1: a round closes with any one learner (paper default)
    grace_window: GraceWindow = Field(default_factory=GraceWindow)
    merge: MergeMethod = "rda"  # the paper's radial-directional averaging; average is the ablation
    token_weighting: bool = True  # w = tokens·(tokens/steps); off gives uniform weights
    # A round holding n of the M active learners moves Θ by n/M of its merged update, so Θ
    # advances by the learners' average progress however the asynchronous rounds split.
    participation_scaling: bool = True
    fragments: int = Field(4, ge=1, le=4096)  # P: 1/P of the model is due per step
    fragmentation: Method = "balanced"  # equal bytes per fragment: even WAN bursts, even merges
    # Syncer processes. Each step's 1/P of the model is cut in one fragment per shard (the plan
    # holds P x shards fragments; fragment q is merged, checkpointed and published by shard
    # q mod shards), so every shard works on every slot and N shards shorten each slot's chain.
    # One is enough for 48 learners of 1e8 parameters and 10-12 of 1e9 at 1 s steps on one core
    # (docs/BENCHMARKS.md §5).
    shards: int = Field(1, ge=1, le=64)
    compression: Codec = "int4"  # +0.09% loss vs bf16
    # Global fragments travel to learners as compressed deltas with error feedback (keyframes
    # in fp32 on (re)connect). int4 halves int8's bytes (85x below bf16 data-parallel at P = 24,
    # int8 45x) at no loss the replay can see (-0.05% against int8, +0.00% against fp32) and
    # +0.17% against int8 in real processes, 3 seeds each (docs/BENCHMARKS.md §14). int8 and
    # fp32 stay for a down-link with bytes to spare.
    broadcast_compression: Codec = "int4"
    block_size: int = Field(64, ge=8, le=65536)  # absmax block for int4, nf4 and int8
    # The outer step for frequent syncs (each fragment every P steps), measured (docs/BENCHMARKS.md,
    # "The outer step"): lr 0.6 with inner lr 9e-3 is the best pair of the replay's grid and beats
    # 0.8 by 2.5% in the real job; 0.8 was best only with an inner lr of 3e-3, and an lr of 1 or
    # more overshoots the learners' drift. DiLoCo's 0.7 / 0.9 were tuned for a sync every ~500
    # steps; momentum re-applies stale updates when syncs are this frequent.
    outer_learning_rate: float = Field(0.6, gt=0.0, le=10.0)
    outer_momentum: float = Field(0.0, ge=0.0, lt=1.0)
    # How a learner takes a published fragment: rebase keeps its own progress that Θ_p does not
    # hold (θ_p ← Θ_p + unmerged progress); overwrite (θ_p ← Θ_p, the first release's rule) is
    # kept as an ablation: it throws away the steps taken while a push was in flight.
    adoption: Adoption = "rebase"
    # Refuse an outer gradient whose norm exceeds this many times the median of the fragment's
    # recent accepted ones (a broken learner's blow-up; docs/OPERATIONS.md, "Integrity"). Its
    # learner re-syncs from Θ. Honest runs, chaos and re-admission included, stay far below it
    # (docs/BENCHMARKS.md, "Outlier refusal"). null turns the check off.
    max_norm_ratio: float | None = Field(20.0, gt=1.0)
    # A syncer crash loses at most this much merging, and learners hand most of it back (Recover);
    # writing more often costs disk bandwidth for no gain.
    checkpoint_interval_seconds: float = Field(30.0, gt=0.0)
    # The checkpoint volume's size on Kubernetes (each shard's, when sharded). Unset: twice what
    # the syncer keeps for the built-in model (diloco/shapes.py sizes it without JAX). A model from
    # spec.model.module has shapes only its code knows, so it needs this set; so does
    # spec.model.pretrained unless the manifest gives the architecture (the operator cannot read it).
    checkpoint_storage: str | None = Field(None, pattern=r"^[1-9][0-9]{0,8}(Mi|Gi|Ti)$")
    # Checkpoints in object storage (s3://, gs://, any fsspec URL); unset: the volume above.
    checkpoints: CheckpointLocation | None = None
    # A standby syncer per shard that takes over from the store (needs `checkpoints`).
    standby: Standby | None = None
    # Re-admission's bulk streams (a Join's whole model, a peer's optimizer state) share this
    # much of the syncer's sending (syncer/joins/pacing.py). Measured with 8 learners of a 1e9 model
    # training on one syncer core and one 4 GB Join (docs/BENCHMARKS.md §5): unpaced, half the
    # slots' merges came late (up to 5.2 s) and the Join took 22 s; at 1 GB/s the same; at
    # 250 MB/s, once the syncer reserved its heap at start, none late and the Join took 16 s.
    # Only while learners push:
    # every learner re-joining a restarted syncer goes at full speed. A quickstart's Join (2 MB)
    # never waits. null: unpaced.
    join_bytes_per_second: float | None = Field(2.5e8, gt=0.0)
    staleness: Staleness = Field(default_factory=Staleness)
    image: str = DEFAULT_SYNCER_IMAGE
    resources: Resources = Field(default_factory=Resources)
    pod: PodOverlay | None = None  # labels, env, volumes, a service account ... (spec/pod.py)
    template: PodTemplate | None = None  # a pod template merged last: sidecars, affinity ... (spec/pod.py)
    external: ExternalSyncer | None = None
    # A Secret in the job's namespace whose key `token` is the job's token, instead of the one
    # the operator generates (`<job>-token`): how a standby's cluster (spec.syncer.standby.cluster)
    # gets the home job's, so every learner's token is good at both syncers of a shard.
    token_secret: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    expose: Expose | None = None
    # Regions of learner groups in other clusters that use this syncer: its status and metrics
    # then break them out by name instead of counting them as "other".
    remote_regions: list[str] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _standby_needs_a_store(self) -> Syncer:
        if self.standby is not None and self.checkpoints is None:
            raise ValueError("spec.syncer.standby: a standby takes over from checkpoints both syncers reach; set "
                             "spec.syncer.checkpoints.url (s3://, gs://) as well")
        if self.standby is not None and self.checkpoints is not None and \
                not self.checkpoints.url.startswith(("s3://", "s3a://", "file://")):
            raise ValueError("spec.syncer.standby: its lease needs a store with conditional writes; the syncer has "
                             "them on s3:// (any S3-compatible store) and file:// (a shared filesystem), not yet "
                             f"on {self.checkpoints.url.split('://', 1)[0]}://")
        if self.standby is not None and self.external is not None:
            raise ValueError("spec.syncer.standby: the syncer is external (spec.syncer.external); configure the "
                             "standby in the cluster that runs it")
        if self.token_secret is not None and self.external is not None:
            raise ValueError("spec.syncer.tokenSecret: the syncer is external; its token is "
                             "spec.syncer.external.tokenSecret's, remove this one")
        standby = self.standby
        if standby is not None and (standby.cluster is None) != (standby.host is None):
            raise ValueError("spec.syncer.standby: `cluster` (the cluster that runs the standby) and `host` (where "
                             "the other clusters dial it) go together; set both, or neither")
        if standby is not None and standby.cluster is not None and standby.peers:
            raise ValueError("spec.syncer.standby.peers: written by the home operator from `cluster` and `host`; "
                             "remove it from the home job")
        if standby is not None and standby.peers and len(standby.peers) != self.shards:
            raise ValueError(f"spec.syncer.standby.peers: {len(standby.peers)} address(es) for a syncer of "
                             f"{self.shards} shard(s); name each shard's other member, in shard order")
        return self

    @property
    def plan_size(self) -> int:
        """The fragments in the plan: P per shard, so each slot has one for every shard."""
        return self.fragments * self.shards
