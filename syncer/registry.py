"""The syncer's learners: who joined, from which region, their sessions, what their pushes'
counters may claim, whether one is live, and who is asked to share optimizer state.

One record per learner id (`LearnerInfo`); sessions and retries are `Admission`'s, the counters'
bounds `Counters`' (syncer/counter_bounds.py), the optimizer-state relay `StateRelay`'s
(syncer/joins/peer_state.py); the registry keeps them together so a Join, a push or a merge updates
each in one call. It takes no lock: the syncer core calls it holding its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.syncer.acceptance import Admission
from diloco.syncer.counter_bounds import Counters
from diloco.syncer.joins.peer_state import StateRelay
from diloco.syncer.round import Round
from diloco.wire import pb

LIVE_SECONDS = 30.0  # a learner seen this recently (or subscribed) is live: its id is taken
# A push this recent means learners are training against this syncer: re-admissions' bulk
# streams are paced then (syncer/joins/pacing.py), and go unpaced when nobody pushes (every learner
# re-joining a restarted syncer), since no round is waiting.
ROUNDS_RUNNING_SECONDS = 10.0


@dataclass(kw_only=True)
class LearnerInfo:
    region: str = ""
    joins: int = 0
    contributions: int = 0
    tokens_merged: int = 0  # credited to it by merges since this syncer started
    last_seen: float = 0.0
    loss: float = float("nan")
    subscriptions: int = 0
    bytes_received: int = 0
    staleness: int = 0  # summed lag of accepted contributions


@dataclass(kw_only=True)
class LearnerRegistry:
    """Learners, their sessions and regions, their Joins and who shares state with whom."""

    admission: Admission  # sessions and retries (shared with the round driver, which records pushes in it)
    counters: Counters  # the bounds on what a process's pushes may claim
    clock: Callable[[], float]
    regions: frozenset[str] = frozenset()  # the job's regions; others are reported as "other"
    learners: dict[str, LearnerInfo] = field(default_factory=dict)
    last_push: float = float("-inf")  # when a push last arrived (`rounds_running`)
    relay: StateRelay = field(init=False)  # peers' optimizer state for re-joining learners

    def __post_init__(self) -> None:
        self.relay = StateRelay(self.clock)

    def region_of(self, learner: str) -> str:
        info = self.learners.get(learner)
        region = info.region if info else ""
        return region if region in self.regions else "other"

    def all_regions(self) -> set[str]:
        """The job's regions and every region a learner reports in."""
        return set(self.regions) | {self.region_of(n) for n in self.learners}

    def active(self) -> set[str]:
        """Learners with a live subscription: those a round waits for."""
        return {name for name, info in self.learners.items() if info.subscriptions > 0}

    def open_session(self, learner: str, process: int, supersede: bool) -> bytes:
        """The joining process's session secret (see `Admission.open_session`); its counters start over."""
        info = self.learners.get(learner)
        live = info is not None and (info.subscriptions > 0 or self.clock() - info.last_seen < LIVE_SECONDS)
        secret = self.admission.open_session(learner, process, supersede, live)
        self.counters.join((learner, process), self.clock())
        return secret

    def check_session(self, learner: str, secret: bytes) -> None:
        self.admission.check_session(learner, secret)

    def joined(self, learner: str, region: str) -> LearnerInfo:
        """Record a Join: the learner's record, its count of joins bumped."""
        info = self.learners.setdefault(learner, LearnerInfo())
        info.region, info.last_seen = region, self.clock()
        info.joins += 1
        return info

    def pushed(self, h: pb.PushHeader) -> LearnerInfo:
        """A push arrived (before its verdict): the learner is seen, its loss shown."""
        info = self.learners.setdefault(h.learner, LearnerInfo(region=h.region))
        info.last_seen = self.clock()
        if math.isfinite(h.loss) and h.loss >= 0:  # shown in status only; never trusted further
            info.loss = h.loss
        self.last_push = info.last_seen
        return info

    def check_counters(self, h: pb.PushHeader, now: float) -> None:
        """The push's step time voted and its counters checked (raises Refused `counters`)."""
        self.counters.observe_step(h.learner, h.step_seconds)
        self.counters.check((h.learner, int(h.session)), h.fragment, base_version=int(h.base_version),
                            steps=int(h.steps), tokens=int(h.tokens), now=now)

    def accepted(self, info: LearnerInfo, *, size: int, lag: int) -> None:
        """An accepted push of `size` bytes, `lag` versions behind."""
        info.contributions += 1
        info.bytes_received += size
        info.staleness += lag

    def merged(self, done: Round) -> None:
        """A round merged, as the round driver returned it: its processes' counters start over
        from their pushes, and each learner is credited its new tokens."""
        origins = [(c.origin, c.received_at) for c in done.closed.contributions]
        self.counters.merged_into(origins, done.fragment, done.result.version)
        for learner, credit in done.result.credits.items():
            self.learners[learner].tokens_merged += credit

    def subscribe(self, learner: str, delta: int) -> None:
        """A subscription stream opened (+1) or closed (-1): the learner is active while it has one."""
        self.learners.setdefault(learner, LearnerInfo()).subscriptions += delta

    def rounds_running(self, seconds: float = ROUNDS_RUNNING_SECONDS) -> bool:
        """Learners are pushing to this syncer (one did in the last `seconds`)."""
        return self.clock() - self.last_push < seconds
