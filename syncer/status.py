"""The syncer's Status reply: what `diloco status`, the local runner and the operator read."""

from __future__ import annotations

import statistics

from diloco.core.rounds import RoundBook
from diloco.syncer.global_model import GlobalModel, Outer
from diloco.syncer.registry import LearnerRegistry
from diloco.syncer.tallies import Tallies
from diloco.wire import pb


def status_reply(*, now: float, incarnation: str, model: GlobalModel, registry: LearnerRegistry, tallies: Tallies,
                 book: RoundBook[Outer], checkpoint_version: int, max_norm_ratio: float, shard: int,
                 shards: int) -> pb.StatusReply:
    """One consistent snapshot of the syncer's parts (the caller holds the core's lock)."""
    learners = [
        pb.LearnerStatus(learner=n, region=i.region, joins=i.joins, contributions=i.contributions,
                         tokens_merged=i.tokens_merged, seconds_since_seen=now - i.last_seen, loss=i.loss,
                         bytes_received=i.bytes_received, tokens_trained=model.credits.reported_by(n))
        for n, i in sorted(registry.learners.items())
    ]
    return pb.StatusReply(
        incarnation=incarnation, versions=list(model.versions),
        outer_steps=model.outer_steps, tokens_merged=model.tokens_merged,
        active_learners=len(registry.active()), learners=learners,
        seconds_since_publish=now - tallies.last_publish, checkpoint_version=checkpoint_version,
        grace_seconds=book.timings.grace(book.policy), step_seconds=book.timings.step.get(),
        contributions_refused=tallies.refused, bytes_received=tallies.bytes_received, bytes_sent=tallies.bytes_sent,
        regions=_regions(registry), max_norm_ratio=max_norm_ratio,
        max_steps_ratio=registry.counters.max_ratio_seen, refused_by_outcome=dict(tallies.refused_by),
        shard=shard, shards=shards,
    )


def _regions(registry: LearnerRegistry) -> list[pb.RegionStatus]:
    """Per region (the caller holds the lock)."""
    active = registry.active()
    out: dict[str, pb.RegionStatus] = {}
    for name, info in registry.learners.items():
        r = out.setdefault(registry.region_of(name), pb.RegionStatus(region=registry.region_of(name)))
        r.learners += 1
        r.active_learners += name in active
        r.tokens_merged += info.tokens_merged
        r.bytes_received += info.bytes_received
        r.contributions += info.contributions
        r.mean_staleness += info.staleness  # a sum until divided below
    for r in out.values():
        r.mean_staleness = r.mean_staleness / r.contributions if r.contributions else 0.0
        steps = [e.get() for n, e in registry.counters.step_seconds.items() if e.value is not None
                 and n in registry.learners and registry.region_of(n) == r.region]
        r.step_seconds = statistics.median(steps) if steps else 0.0
    return [out[k] for k in sorted(out)]
