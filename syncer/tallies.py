"""The syncer's tallies: what its status reply and metrics show of accepted and refused pushes,
bytes sent, merges and active learners.

Fed by results: an accepted push's size and lag, a merged `Round` as the round driver returns
it (syncer/round.py), the registry's active learners by region. It takes no lock: the syncer
core calls it holding its own (the metrics are thread-safe on their own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from diloco.core.rounds import RoundBook
from diloco.syncer.global_model import Outer
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.round import Round


@dataclass(kw_only=True)
class Tallies:
    """Counts and metrics of what the syncer took, refused, merged and sent."""

    metrics: SyncerMetrics
    clock: Callable[[], float]
    refused: int = 0
    refused_by: dict[str, int] = field(default_factory=dict)  # by outcome
    bytes_received: int = 0
    bytes_sent: int = 0
    last_publish: float = field(init=False)  # the clock at the newest merge (or at start)

    def __post_init__(self) -> None:
        self.last_publish = self.clock()

    def refusal(self, outcome: str) -> None:
        self.refused += 1
        self.refused_by[outcome] = self.refused_by.get(outcome, 0) + 1
        self.metrics.contributions.labels(outcome).inc()

    def checked_norm(self, ratio: float | None) -> None:
        """An offered push's norm over its fragment's median (None: too few pushes yet to check)."""
        if ratio is not None:
            self.metrics.norm_ratio.observe(ratio)

    def accepted(self, region: str, *, size: int, lag: int) -> None:
        """An accepted push of `size` bytes, `lag` versions behind, from a learner in `region`."""
        self.bytes_received += size
        self.metrics.bytes_received.inc(size)
        self.metrics.region_bytes.labels(region).inc(size)
        self.metrics.contributions.labels("accepted").inc()
        self.metrics.staleness.observe(lag)
        self.metrics.region_staleness.labels(region).observe(lag)

    def sent(self, n: int) -> None:
        self.bytes_sent += n
        self.metrics.bytes_sent.inc(n)

    def merged(self, done: Round, book: RoundBook[Outer], version_sum: int, region_of: Callable[[str], str]) -> None:
        """A merged round as the driver returned it; `book`: its round book (the grace window and step time)."""
        result, closed = done.result, done.closed
        for learner, credit in result.credits.items():
            self.metrics.region_tokens.labels(region_of(learner)).inc(credit)
        self.last_publish = self.clock()
        self.metrics.merges.inc()
        self.metrics.tokens.inc(result.tokens_merged)
        self.metrics.quorum_size.observe(len(closed.contributions))
        self.metrics.grace_wait.observe(max(0.0, done.closed_at - (done.deadline - book.timings.grace(book.policy))))
        self.metrics.outer_version.set(version_sum)
        self.metrics.step_seconds.set(book.timings.step.get())
        self.metrics.last_publish.set(time.time())

    def active(self, active: set[str], regions: Iterable[str], region_of: Callable[[str], str]) -> None:
        """Active learners, in all and by region."""
        self.metrics.active.set(len(active))
        for region in regions:
            self.metrics.region_learners.labels(region).set(sum(1 for n in active if region_of(n) == region))
