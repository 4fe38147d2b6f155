"""The syncer's Status reply: what `diloco status`, the local runner and the operator read."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from diloco.wire import pb

if TYPE_CHECKING:
    from diloco.syncer.service import SyncerCore


def status_reply(core: SyncerCore) -> pb.StatusReply:
    """One consistent snapshot, taken under the core's lock."""
    with core.lock:
        now = core.clock()
        learners = [
            pb.LearnerStatus(learner=n, region=i.region, joins=i.joins, contributions=i.contributions,
                             tokens=i.tokens, seconds_since_seen=now - i.last_seen, loss=i.loss,
                             bytes_received=i.bytes_received, tokens_trained=core.model.reported_by(n))
            for n, i in sorted(core.learners.items())
        ]
        return pb.StatusReply(
            incarnation=core.incarnation, versions=list(core.model.versions),
            outer_steps=core.model.outer_steps, tokens_merged=core.model.tokens_merged,
            active_learners=len(core.active_learners()), learners=learners,
            seconds_since_publish=now - core.last_publish, checkpoint_version=core.checkpoint_version,
            grace_seconds=core.book.timings.grace(core.book.policy), step_seconds=core.book.timings.step.get(),
            contributions_refused=core.refused, bytes_received=core.bytes_received, bytes_sent=core.bytes_sent,
            regions=_regions(core), max_norm_ratio=core.admission.max_ratio_seen,
            max_steps_ratio=core.counters.max_ratio_seen, refused_by_outcome=dict(core.refused_by),
            shard=core.shard, shards=core.spec.shards,
        )


def _regions(core: SyncerCore) -> list[pb.RegionStatus]:
    """Per region (the caller holds the lock)."""
    active = core.active_learners()
    out: dict[str, pb.RegionStatus] = {}
    for name, info in core.learners.items():
        r = out.setdefault(core.region_of(name), pb.RegionStatus(region=core.region_of(name)))
        r.learners += 1
        r.active_learners += name in active
        r.tokens_merged += info.tokens
        r.bytes_received += info.bytes_received
        r.contributions += info.contributions
        r.mean_staleness += info.staleness  # a sum until divided below
    for r in out.values():
        r.mean_staleness = r.mean_staleness / r.contributions if r.contributions else 0.0
        steps = [e.get() for n, e in core.counters.step_seconds.items() if e.value is not None
                 and n in core.learners and core.region_of(n) == r.region]
        r.step_seconds = statistics.median(steps) if steps else 0.0
    return [out[k] for k in sorted(out)]
