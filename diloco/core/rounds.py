"""Per-fragment rounds: staleness, the shared schedule, minimum quorum and the adaptive
grace window (docs/ALGORITHM.md, "The syncer").

Pure logic with the clock passed in as `now` (seconds), so every decision can be
scripted in tests. The syncer owns one `RoundBook` and asks it, on each arrival and
on a timer, which fragments are ready to merge.

A round of fragment p collects the pushes of one schedule slot of p. It starts with
its first on-schedule contribution, may close once K distinct learners are in
(quorum), then waits at most the grace window
ξ_grace = clamp(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, cap) for more, and closes at once
when every active learner is in. A push for a slot of p that has already closed is
late: it rides along with the next round of p instead of opening a lone round of its
own (which would republish p out of schedule), and only if no on-schedule push comes
within P step times does it close a round by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Literal, TypeVar

Payload = TypeVar("Payload")
StalePolicy = Literal["accept", "downweight", "drop"]


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
    """spec.syncer's quorum, grace window and staleness (syncer/global_model.py `round_policy`)."""

    quorum: int
    gamma: float
    tau: int
    cap_seconds: float | None  # None: τ step times (only the formula bounds the wait)
    max_staleness: int
    stale_policy: StalePolicy
    num_fragments: int  # P: a late push waits up to P step times for its round


@dataclass
class Timings:
    step: Ema = field(default_factory=Ema)
    quorum: Ema = field(default_factory=Ema)
    sync: Ema = field(default_factory=Ema)

    def grace(self, policy: RoundPolicy) -> float:
        step = self.step.get()
        cap = policy.tau * step if policy.cap_seconds is None else policy.cap_seconds
        slack = policy.tau * step - self.quorum.get() - self.sync.get()
        return min(max(policy.gamma * slack, 0.0), cap)


@dataclass(frozen=True, kw_only=True)
class Contribution(Generic[Payload]):
    """A push as the syncer merges it: the round's input, generic over its payload (the outer
    gradient's tensors on the syncer; anything in tests). The syncer makes one from a push's
    wire header in one place (syncer/round.py `contribution`); by keyword only, like the
    learner's record of a push (core/ledger.py `Push`), so no caller mixes up its counts."""

    learner: str
    fragment: int
    base_version: int
    steps: int
    tokens: int  # tokens since the anchor: with `steps`, the merge weight
    payload: Payload
    session: int = 0  # (learner, session) is one learner process: its pushes are disjoint progress
    push_id: int = 0
    slot: int | None = None  # the schedule slot; None: on schedule by definition
    session_tokens: int = 0  # the session's cumulative trained tokens at this push (as far as credited)
    received_at: float = 0.0  # when the syncer took it (its clock): where the learner's counters start over once merged

    @property
    def origin(self) -> tuple[str, int]:
        return (self.learner, self.session)


class Verdict(Enum):
    ACCEPTED = "accepted"
    STALE = "stale"  # lag beyond the bound, or any lag under the drop policy
    FUTURE = "future"  # made against a version this syncer never published: rejoin


@dataclass(frozen=True)
class Offer:
    verdict: Verdict
    lag: int
    reason: str = ""
    late: bool = False  # accepted, but its slot had closed: its learner is behind the schedule


@dataclass
class _Round(Generic[Payload]):
    first_at: float | None = None  # first on-schedule arrival
    quorum_at: float | None = None
    late_since: float | None = None  # first late arrival, while no on-schedule one is in
    slot: int = -1  # the newest on-schedule slot in the round
    entries: dict[tuple[str, int], Contribution[Payload]] = field(default_factory=dict)
    on_time: set[str] = field(default_factory=set)  # learners with an on-schedule push in

    def learners(self) -> set[str]:
        return {origin[0] for origin in self.entries}


@dataclass(frozen=True)
class Closed(Generic[Payload]):
    fragment: int
    version: int  # the version the merge is applied to
    contributions: list[Contribution[Payload]]
    scales: list[float]  # staleness factors, applied to the outer gradients themselves
    quorum_seconds: float
    slot: int = -1  # the newest on-schedule slot merged (-1: none)


class RoundBook(Generic[Payload]):
    """Open rounds of all P fragments. Versions belong to the global model and come in
    as `current`, so there is one source of truth for them. `combine` sums two disjoint
    pushes of one learner process that land in the same round (a flush at shutdown)."""

    def __init__(self, num_fragments: int, policy: RoundPolicy,
                 combine: Callable[[Contribution[Payload], Contribution[Payload]], Contribution[Payload]] | None = None):
        if num_fragments < 1:
            raise ValueError("need at least one fragment")
        self.policy = policy
        self.timings = Timings()
        self.combine = combine or (lambda old, new: new)
        self._rounds: list[_Round[Payload]] = [_Round() for _ in range(num_fragments)]
        self.closed_slot = [-1] * num_fragments  # newest on-schedule slot merged, per fragment
        self.next_slot = 0  # the schedule position: one past the newest slot any push filled

    def offer(self, c: Contribution[Payload], now: float, current: int) -> Offer:
        """Admit a contribution made against `c.base_version` while the fragment is at `current`."""
        lag = current - c.base_version
        if lag < 0:
            return Offer(Verdict.FUTURE, lag, f"base version {c.base_version} is ahead of {current}; rejoin")
        if lag > self.policy.max_staleness or (lag and self.policy.stale_policy == "drop"):
            return Offer(Verdict.STALE, lag, f"{lag} versions behind (bound {self.policy.max_staleness})")
        rnd = self._rounds[c.fragment]
        old = rnd.entries.get(c.origin)
        rnd.entries[c.origin] = c if old is None else self.combine(old, c)
        late = c.slot is not None and c.slot <= self.closed_slot[c.fragment]
        if c.slot is not None:
            self.next_slot = max(self.next_slot, c.slot + 1)
        if late:
            if rnd.first_at is None and rnd.late_since is None:
                rnd.late_since = now
            return Offer(Verdict.ACCEPTED, lag, late=True)
        if c.slot is not None:
            rnd.slot = max(rnd.slot, c.slot)
        if rnd.first_at is None:
            rnd.first_at = now
        rnd.on_time.add(c.learner)
        if rnd.quorum_at is None and len(rnd.on_time) >= self.policy.quorum:
            rnd.quorum_at = now
        return Offer(Verdict.ACCEPTED, lag)

    def contributors(self, fragment: int) -> set[str]:
        return self._rounds[fragment].learners()

    def deadline(self, fragment: int) -> float | None:
        """When the round may close at the latest (None: nothing to close yet)."""
        rnd = self._rounds[fragment]
        if rnd.quorum_at is not None:
            return rnd.quorum_at + self.timings.grace(self.policy)
        if rnd.first_at is None and rnd.late_since is not None:
            # Only late pushes: wait about one schedule period for their round's on-time pushes.
            return rnd.late_since + self.policy.num_fragments * self.timings.step.get() + self.timings.grace(self.policy)
        return None

    def ready(self, now: float, active: set[str]) -> list[int]:
        """Fragments whose round should close now."""
        out = []
        for p, rnd in enumerate(self._rounds):
            if not rnd.entries:
                continue
            everyone_in = rnd.quorum_at is not None and bool(active) and active <= rnd.learners()
            deadline = self.deadline(p)
            if everyone_in or (deadline is not None and now >= deadline):
                out.append(p)
        return out

    def pending(self) -> list[int]:
        """Fragments with contributions waiting, whatever their quorum (for a final flush)."""
        return [p for p, rnd in enumerate(self._rounds) if rnd.entries]

    def close(self, fragment: int, version: int) -> Closed[Payload]:
        """Take the round's contributions (to merge into `version`); the next round starts empty."""
        rnd = self._rounds[fragment]
        if not rnd.entries:
            raise RuntimeError(f"fragment {fragment} has no contributions to close")
        entries = sorted(rnd.entries.values(), key=lambda c: c.origin)
        scales = [self._scale(version - c.base_version) for c in entries]
        quorum_seconds = 0.0
        if rnd.quorum_at is not None and rnd.first_at is not None:
            quorum_seconds = rnd.quorum_at - rnd.first_at
            self.timings.quorum.update(quorum_seconds)
        self.closed_slot[fragment] = max(self.closed_slot[fragment], rnd.slot)
        self._rounds[fragment] = _Round()
        return Closed(fragment, version, entries, scales, quorum_seconds, self.closed_slot[fragment])

    def published(self, sync_seconds: float) -> None:
        """Learn how long merging and publishing took (ξ_sync)."""
        self.timings.sync.update(sync_seconds)

    def observe_step_time(self, seconds: float) -> None:
        if seconds > 0:
            self.timings.step.update(seconds)

    def _scale(self, lag: int) -> float:
        """An absolute factor on a stale outer gradient: `downweight` applies 1/(1 + lag) of it."""
        if lag and self.policy.stale_policy == "downweight":
            return 1.0 / (1 + lag)
        return 1.0

    def reset(self, fragment: int) -> None:
        """Forget the open round of a fragment (tests restore a syncer's state with it)."""
        self._rounds[fragment] = _Round()

    def schedule_state(self) -> dict[str, object]:
        return {"next_slot": self.next_slot, "closed_slot": list(self.closed_slot)}

    def load_schedule(self, state: dict[str, object]) -> None:
        self.next_slot, self.closed_slot = checked_schedule(state, len(self._rounds))


def checked_schedule(state: object, num_fragments: int) -> tuple[int, list[int]]:
    """(next slot, newest closed slot per fragment) from checkpointed state, or ValueError."""
    if not isinstance(state, dict):
        raise ValueError("checkpoint schedule is malformed")
    nxt, closed = state.get("next_slot", 0), state.get("closed_slot", [-1] * num_fragments)
    if (not isinstance(nxt, int) or nxt < 0 or not isinstance(closed, list) or len(closed) != num_fragments
            or any(not isinstance(v, int) or v < -1 for v in closed)):
        raise ValueError("checkpoint schedule is malformed")
    return nxt, list(closed)
