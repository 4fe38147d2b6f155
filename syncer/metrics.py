"""Prometheus metrics of the syncer; names follow Prometheus conventions (base units, _total)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Outcomes of a push or recovery offer: merged; too stale; for a future version; malformed;
# NaN or Inf; an outlier by norm; a recovery offer without this job's provenance tag; a request
# from a process that does not hold the learner id it claims.
OUTCOMES = ("accepted", "stale", "future", "invalid", "nonfinite", "outlier", "forged", "impostor", "misrouted",
            "counters")


class SyncerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.merges = Counter("diloco_syncer_merges_total", "Outer steps applied (one fragment each)", registry=r)
        self.tokens = Counter("diloco_syncer_tokens_merged_total", "Training tokens merged into the global model", registry=r)
        self.contributions = Counter(
            "diloco_syncer_contributions_total", "Outer-gradient pushes by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:  # every series exists from the start, so rates and alerts see 0, not nothing
            self.contributions.labels(outcome)
        self.joins = Counter("diloco_syncer_joins_total", "Learner joins; a repeat join is a re-admission", ["kind"], registry=r)
        self.bytes_received = Counter("diloco_syncer_received_bytes_total", "Bytes of outer gradients received", registry=r)
        self.bytes_sent = Counter("diloco_syncer_sent_bytes_total", "Bytes of global fragments and joins sent", registry=r)
        self.quorum_size = Histogram(
            "diloco_syncer_quorum_size", "Learners merged per round", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r
        )
        self.grace_wait = Histogram(
            "diloco_syncer_grace_wait_seconds", "Time from quorum to merge",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=r,
        )
        self.staleness = Histogram(
            "diloco_syncer_contribution_staleness_versions", "Versions a merged contribution lagged",
            buckets=(0, 1, 2, 4, 8), registry=r,
        )
        self.norm_ratio = Histogram(
            "diloco_syncer_push_norm_ratio", "A push's outer-gradient norm over its fragment's recent median",
            buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16), registry=r,
        )
        self.active = Gauge("diloco_syncer_active_learners", "Learners with a live subscription", registry=r)
        self.outer_version = Gauge("diloco_syncer_outer_version", "Sum of the fragments' versions", registry=r)
        self.step_seconds = Gauge("diloco_syncer_learner_step_seconds", "EMA of learners' step time", registry=r)
        self.merge_errors = Counter("diloco_syncer_merge_errors_total", "Rounds that failed to merge", registry=r)
        self.checkpoint_errors = Counter(
            "diloco_syncer_checkpoint_errors_total", "Checkpoints that could not be written", registry=r
        )
        # A syncer with a standby (spec.syncer.standby): 1 while it holds the lease and serves,
        # 0 while it stands by; its lease epoch; and 1 when it came to hold it by a takeover.
        self.leader = Gauge("diloco_syncer_leader", "1 when this syncer holds the publish lease, 0 on standby",
                            registry=r)
        self.lease_epoch = Gauge("diloco_syncer_lease_epoch", "The leader lease's epoch this syncer holds", registry=r)
        self.takeovers = Counter("diloco_syncer_takeovers_total",
                                 "Times this syncer took the lease over from a silent active syncer", registry=r)
        # Per region (bounded: the job's regions plus "other"), for multi-region jobs.
        self.region_learners = Gauge("diloco_syncer_region_learners", "Learners with a live subscription, by region",
                                     ["region"], registry=r)
        self.region_tokens = Counter("diloco_syncer_region_tokens_total", "Tokens merged, by the learners' region",
                                     ["region"], registry=r)
        self.region_bytes = Counter("diloco_syncer_region_received_bytes_total",
                                    "Bytes of outer gradients received, by region", ["region"], registry=r)
        self.region_staleness = Histogram(
            "diloco_syncer_region_staleness_versions", "Versions an accepted contribution lagged, by region",
            ["region"], buckets=(0, 1, 2, 4, 8), registry=r,
        )
        self.last_publish = Gauge(
            "diloco_syncer_last_publish_timestamp_seconds", "Unix time of the latest publish", registry=r
        )
