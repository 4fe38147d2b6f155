"""The syncer's tallies: what its status reply and metrics show of accepted pushes, merges and
active learners. The syncer core calls these holding its lock (where they say so)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from diloco.syncer.round import Round

if TYPE_CHECKING:
    from diloco.syncer.service import LearnerInfo, SyncerCore


def count_accepted(core: SyncerCore, learner: str, info: LearnerInfo, *, size: int, lag: int) -> None:
    """An accepted push of `size` bytes, `lag` versions behind (the caller holds the lock)."""
    info.contributions += 1
    info.bytes_received += size
    info.staleness += lag
    core.bytes_received += size
    region = core.region_of(learner)
    core.metrics.bytes_received.inc(size)
    core.metrics.region_bytes.labels(region).inc(size)
    core.metrics.contributions.labels("accepted").inc()
    core.metrics.staleness.observe(lag)
    core.metrics.region_staleness.labels(region).observe(lag)


def count_merge(core: SyncerCore, done: Round) -> None:
    """Learners' counters, status and metrics of a committed merge (the driver holds the lock)."""
    result, closed, book = done.result, done.closed, core.book
    core.counters.merged_into([(c.origin, c.received_at) for c in closed.contributions], done.fragment,
                              result.version)
    for learner, credit in result.credits.items():
        core.learners[learner].tokens += credit
        core.metrics.region_tokens.labels(core.region_of(learner)).inc(credit)
    core.last_publish = core.clock()
    core.metrics.merges.inc()
    core.metrics.tokens.inc(result.tokens)
    core.metrics.quorum_size.observe(len(closed.contributions))
    core.metrics.grace_wait.observe(max(0.0, done.closed_at - (done.deadline - book.timings.grace(book.policy))))
    core.metrics.outer_version.set(sum(core.model.versions))
    core.metrics.step_seconds.set(book.timings.step.get())
    core.metrics.last_publish.set(time.time())


def set_active_gauges(core: SyncerCore) -> None:
    """Active learners, in all and by region (takes the lock)."""
    with core.lock:
        active = core.active_learners()
        core.metrics.active.set(len(active))
        for region in core.regions | {core.region_of(n) for n in core.learners}:
            core.metrics.region_learners.labels(region).set(sum(1 for n in active if core.region_of(n) == region))
