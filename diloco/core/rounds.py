"""Per-fragment rounds: staleness, minimum quorum and the adaptive grace window (SPEC §2).

Pure logic with the clock passed in as `now` (seconds), so every decision can be
scripted in tests. The syncer owns one `RoundBook` and asks it, on each arrival and
on a timer, which fragments are ready to merge.

A round of fragment p at version v starts with its first contribution. It may close
once K distinct learners have contributed (quorum), then waits at most the grace
window ξ_grace = clamp(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, cap) for more, and closes
at once when every active learner is in. ξ_quorum runs from the first arrival to the
K-th, because learners push each fragment at their own pace and the first arrival
marks when the fragment became due.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Literal, TypeVar

Payload = TypeVar("Payload")
StalePolicy = Literal["downweight", "drop", "reanchor"]


@dataclass
class Ema:
    """Exponential moving average; the first sample sets it."""

    alpha: float = 0.2  # ~5-sample memory: adapts within a few rounds, ignores one outlier
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


@dataclass(frozen=True)
class RoundPolicy:
    quorum: int = 1
    gamma: float = 0.8
    tau: int = 2
    cap_seconds: float | None = None  # None: one step time
    max_staleness: int = 2
    stale_policy: StalePolicy = "downweight"


@dataclass
class Timings:
    step: Ema = field(default_factory=Ema)
    quorum: Ema = field(default_factory=Ema)
    sync: Ema = field(default_factory=Ema)

    def grace(self, policy: RoundPolicy) -> float:
        step = self.step.get()
        cap = step if policy.cap_seconds is None else policy.cap_seconds
        slack = policy.tau * step - self.quorum.get() - self.sync.get()
        return min(max(policy.gamma * slack, 0.0), cap)


@dataclass(frozen=True)
class Contribution(Generic[Payload]):
    learner: str
    fragment: int
    base_version: int
    steps: int
    tokens: int
    payload: Payload


class Verdict(Enum):
    ACCEPTED = "accepted"
    STALE = "stale"  # lag beyond the bound, or any lag under the drop policy
    FUTURE = "future"  # made against a version this syncer never published: rejoin


@dataclass(frozen=True)
class Offer:
    verdict: Verdict
    lag: int
    reason: str = ""


@dataclass
class _Round(Generic[Payload]):
    first_at: float | None = None
    quorum_at: float | None = None
    entries: dict[str, Contribution[Payload]] = field(default_factory=dict)


@dataclass(frozen=True)
class Closed(Generic[Payload]):
    fragment: int
    version: int  # the version the merge is applied to
    contributions: list[Contribution[Payload]]
    scales: list[float]  # staleness multipliers for the merge weights
    quorum_seconds: float


class RoundBook(Generic[Payload]):
    """Open rounds of all P fragments. Versions belong to the global model and come in
    as `current`, so there is one source of truth for them."""

    def __init__(self, num_fragments: int, policy: RoundPolicy):
        if num_fragments < 1:
            raise ValueError("need at least one fragment")
        self.policy = policy
        self.timings = Timings()
        self._rounds: list[_Round[Payload]] = [_Round() for _ in range(num_fragments)]

    def offer(self, c: Contribution[Payload], now: float, current: int) -> Offer:
        """Admit a contribution made against `c.base_version` while the fragment is at `current`."""
        lag = current - c.base_version
        if lag < 0:
            return Offer(Verdict.FUTURE, lag, f"base version {c.base_version} is ahead of {current}; rejoin")
        if lag > self.policy.max_staleness or (lag and self.policy.stale_policy == "drop"):
            return Offer(Verdict.STALE, lag, f"{lag} versions behind (bound {self.policy.max_staleness})")
        rnd = self._rounds[c.fragment]
        if rnd.first_at is None:
            rnd.first_at = now
        rnd.entries[c.learner] = c  # a newer push supersedes: Δ is cumulative since the anchor
        if rnd.quorum_at is None and len(rnd.entries) >= self.policy.quorum:
            rnd.quorum_at = now
        return Offer(Verdict.ACCEPTED, lag)

    def contributors(self, fragment: int) -> set[str]:
        return set(self._rounds[fragment].entries)

    def deadline(self, fragment: int) -> float | None:
        """When the round may close at the latest (None: quorum not reached yet)."""
        rnd = self._rounds[fragment]
        if rnd.quorum_at is None:
            return None
        return rnd.quorum_at + self.timings.grace(self.policy)

    def ready(self, now: float, active: set[str]) -> list[int]:
        """Fragments whose round should close now."""
        out = []
        for p, rnd in enumerate(self._rounds):
            if rnd.quorum_at is None:
                continue
            everyone_in = bool(active) and active <= set(rnd.entries)
            deadline = self.deadline(p)
            if everyone_in or (deadline is not None and now >= deadline):
                out.append(p)
        return out

    def close(self, fragment: int, version: int) -> Closed[Payload]:
        """Take the round's contributions (to merge into `version`); the next round starts empty."""
        rnd = self._rounds[fragment]
        if rnd.quorum_at is None or rnd.first_at is None:
            raise RuntimeError(f"fragment {fragment} has not reached quorum")
        entries = sorted(rnd.entries.values(), key=lambda c: c.learner)
        scales = [self._scale(version - c.base_version) for c in entries]
        quorum_seconds = rnd.quorum_at - rnd.first_at
        self.timings.quorum.update(quorum_seconds)
        self._rounds[fragment] = _Round()
        return Closed(fragment, version, entries, scales, quorum_seconds)

    def published(self, sync_seconds: float) -> None:
        """Learn how long merging and publishing took (ξ_sync)."""
        self.timings.sync.update(sync_seconds)

    def observe_step_time(self, seconds: float) -> None:
        if seconds > 0:
            self.timings.step.update(seconds)

    def _scale(self, lag: int) -> float:
        if lag and self.policy.stale_policy == "downweight":
            return 1.0 / (1 + lag)
        return 1.0

    def reset(self, fragment: int) -> None:
        """Forget the open round of a fragment whose global value was replaced (recovery)."""
        self._rounds[fragment] = _Round()
