"""The learner's session with one syncer, as a pure state machine: events in, actions out.

`SyncerClient` (trainer/sync/client.py) does the I/O: it joins, runs a sender and a subscriber
thread, and turns what each RPC did into an event (a join admitted or failed, a push answered
or failed, a subscription's stream broken). `Session.on` decides what follows, as a list of
actions the client carries out: retry after a backoff, put a push back, re-join a restarted
syncer (once, however many threads notice), hand the loop a refusal, stop for good. Nothing
here touches the network, a thread or the clock; the jitter's randomness is passed in, so a
table of (events, actions) tests the whole policy (tests/trainer/sync/test_session.py).

Status codes arrive as their names (grpc.StatusCode.X.name), so this module imports no gRPC.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

from diloco.contract import Event as Ev

# The syncer refused this learner for good (a wrong token, a revoked id): retrying cannot help.
FATAL = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
RESTARTED = "FAILED_PRECONDITION"  # the syncer restarted (another incarnation): re-join it
MALFORMED = "INVALID_ARGUMENT"  # the syncer found what we sent malformed, or will not admit us


@dataclass
class Backoff:
    """Capped exponential backoff with jitter, so restarted learners do not stampede."""

    base: float = 0.2
    cap: float = 5.0
    attempt: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def next(self) -> float:
        self.attempt += 1
        return min(self.cap, self.base * 2 ** (self.attempt - 1)) * (0.5 + self.rng.random() / 2)

    def reset(self) -> None:
        self.attempt = 0


class Phase(enum.Enum):
    JOINING = "joining"  # before the first admission
    LIVE = "live"  # admitted: the sender and the subscriber run
    REJOINING = "rejoining"  # the syncer restarted: one thread re-joins, the other waits for it
    STOPPED = "stopped"  # refused for good


# -- events: what an RPC did --------------------------------------------------------------

@dataclass(frozen=True)
class JoinStarted:
    """join_with_retry begins: its backoff starts over."""


@dataclass(frozen=True)
class Joined:
    incarnation: str


@dataclass(frozen=True)
class Unseeded:
    """A join found the syncer (shard) without Θ₀; `can_seed`: we hold ours, `holds_view`: a copy
    of the global model from before (the syncer lost its state)."""

    shard: int
    shards: int
    can_seed: bool
    holds_view: bool


@dataclass(frozen=True)
class JoinFailed:
    code: str  # a status code's name, or CONNECTION: the stream ended early or spoke nonsense
    details: str


@dataclass(frozen=True)
class Rejoined:
    incarnation: str


@dataclass(frozen=True)
class RejoinFailed:
    reason: str


@dataclass(frozen=True)
class RejoinAborted:
    """The re-join broke off on an error no refusal covers (it propagates): the next notice of
    the restart may try again."""


@dataclass(frozen=True)
class PushAccepted:
    pass


@dataclass(frozen=True)
class PushRefused:
    """The syncer answered, and did not take the push (too stale, a repeat)."""

    fragment: int
    reason: str


@dataclass(frozen=True)
class PushFailed:
    """The push's RPC failed (a timeout is DEADLINE_EXCEEDED)."""

    code: str
    details: str
    fragment: int
    incarnation: str  # the one the push was made against


@dataclass(frozen=True)
class StreamData:
    """The subscription delivered its first message."""


@dataclass(frozen=True)
class StreamEnded:
    """The subscription's stream ended cleanly (the syncer closed it)."""


@dataclass(frozen=True)
class StreamMalformed:
    reason: str  # a published fragment that does not decode: a fresh subscription sends keyframes


@dataclass(frozen=True)
class StreamBroken:
    code: str
    details: str
    incarnation: str  # the one the subscription was for


@dataclass(frozen=True)
class Woken:
    """A re-join (or close) cut the subscriber's backoff short."""


Event = (JoinStarted | Joined | Unseeded | JoinFailed | Rejoined | RejoinFailed | RejoinAborted | PushAccepted
         | PushRefused
         | PushFailed | StreamData | StreamEnded | StreamMalformed | StreamBroken | Woken)


# -- actions: what the client does next ----------------------------------------------------

@dataclass(frozen=True)
class Emit:
    event: str  # a contract.Event
    fields: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Wait:
    """Back off before the next try; `wakeable`: a re-join may cut it short."""

    seconds: float
    reason: str
    wakeable: bool = False


@dataclass(frozen=True)
class Seed:
    shard: int
    shards: int


@dataclass(frozen=True)
class RecoverState:
    """Offer the syncer the newest global fragments we hold (a restarted syncer may adopt them)."""


@dataclass(frozen=True)
class Retry:
    """Try the same call again now."""


@dataclass(frozen=True)
class Reraise:
    """The failure is not ours to handle here: the caller sees it."""


@dataclass(frozen=True)
class Refuse:
    """Raise to the caller of the join: `token` (Unauthenticated) or `admission` (JoinRefused)."""

    kind: str
    message: str


@dataclass(frozen=True)
class Rejoin:
    """Offer our copy, then re-join; feed Rejoined or RejoinFailed after."""


@dataclass(frozen=True)
class AwaitRejoin:
    """Another thread is re-joining: wait until it is done."""


@dataclass(frozen=True)
class HandOver:
    """Give the loop the re-join's state at its next step boundary."""


@dataclass(frozen=True)
class WakeSubscriber:
    pass


@dataclass(frozen=True)
class Requeue:
    """Put the push back at the front of the outbox (the syncer ignores a repeat it holds)."""


@dataclass(frozen=True)
class RecordRefused:
    """Tell the loop the push was refused."""


@dataclass(frozen=True)
class Resync:
    """Our weights are suspect: the loop starts over from the global model."""


@dataclass(frozen=True)
class Fatal:
    """Emit the fatal event and stop the learner."""

    reason: str


Action = (Emit | Wait | Seed | RecoverState | Retry | Reraise | Refuse | Rejoin | AwaitRejoin | HandOver
          | WakeSubscriber | Requeue | RecordRefused | Resync | Fatal)


class Session:
    """Where this learner stands with one syncer, and what each event makes of it."""

    # rng: the backoffs' jitter; a test passes a seeded one (the default draws from the OS).
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random()
        self.phase = Phase.JOINING
        self.incarnation = ""  # the syncer's, as of our latest admission
        self.backoff = {name: Backoff(rng=self.rng) for name in ("join", "send", "subscribe")}

    def on(self, event: Event) -> list[Action]:
        """What follows `event` (and the session's new phase)."""
        match event:
            case JoinStarted():
                self.backoff["join"].reset()
                return []
            case Joined(incarnation):
                self.incarnation = incarnation
                self.phase = Phase.LIVE if self.phase is Phase.JOINING else self.phase
                return []
            case Unseeded() | JoinFailed():
                return self._join_failed(event)
            case Rejoined(incarnation):
                self.phase = Phase.LIVE
                return [HandOver(), WakeSubscriber(), Emit(Ev.REJOINED, (("incarnation", incarnation),))]
            case RejoinFailed(reason):
                return self._fatal(reason)
            case RejoinAborted():
                self.phase = Phase.LIVE if self.phase is Phase.REJOINING else self.phase
                return []
            case PushAccepted() | PushRefused() | PushFailed():
                return self._pushed(event)
            case StreamData() | Woken():
                self.backoff["subscribe"].reset()
                return []
            case StreamEnded():
                return []  # subscribe again at once
            case StreamMalformed(reason):  # a fresh subscription starts with keyframes
                return [Emit(Ev.DISCONNECTED, (("reason", reason), ("retry_seconds", 0)))]
            case StreamBroken():
                return self._stream_broken(event)
        raise TypeError(f"not a session event: {event!r}")

    def _join_failed(self, e: Unseeded | JoinFailed) -> list[Action]:
        if isinstance(e, Unseeded):  # seed it with our Θ₀ (and offer our copy), then join again
            if not e.can_seed:
                return [Reraise()]
            return [Seed(e.shard, e.shards), *([RecoverState()] if e.holds_view else []), Retry()]
        if e.code in FATAL:
            return [Refuse("token", e.details)]
        if e.code in (RESTARTED, MALFORMED):
            return [Refuse("admission", f"syncer refused to admit this learner: {e.details}")]
        # ALREADY_EXISTS: the id's live holder may be on its way out; the rest: unreachable.
        return [Wait(self.backoff["join"].next(), e.details if e.code == "CONNECTION" else e.code)]

    def _restarted(self, stale: str) -> list[Action]:
        """The syncer restarted. The first to notice re-joins; a later notice of the same restart
        waits for that re-join; one about an incarnation we already left finds the work done."""
        if stale != self.incarnation or self.phase is Phase.STOPPED:
            return []
        if self.phase is Phase.REJOINING:
            return [AwaitRejoin()]
        self.phase = Phase.REJOINING
        return [Rejoin()]

    def _fatal(self, reason: str) -> list[Action]:
        self.phase = Phase.STOPPED
        return [Fatal(reason)]

    def _pushed(self, e: PushAccepted | PushRefused | PushFailed) -> list[Action]:
        if not isinstance(e, PushFailed):  # answered: the syncer is reachable
            self.backoff["send"].reset()
            return [] if isinstance(e, PushAccepted) else \
                [Emit(Ev.PUSH_REFUSED, (("fragment", e.fragment), ("reason", e.reason)))]
        if e.code == RESTARTED:
            return self._restarted(e.incarnation)
        if e.code in FATAL:
            return self._fatal(f"syncer refused this learner: {e.details}")
        if e.code == MALFORMED:  # our outer gradient is malformed or non-finite: our weights are suspect
            return [Emit(Ev.PUSH_REFUSED, (("fragment", e.fragment), ("reason", e.details))), RecordRefused(), Resync()]
        return [Requeue(), Wait(self.backoff["send"].next(), e.code)]  # unreachable: send it again later

    def _stream_broken(self, e: StreamBroken) -> list[Action]:
        if e.code == RESTARTED:
            return self._restarted(e.incarnation)
        if e.code in FATAL:
            return self._fatal(f"syncer refused this learner: {e.details}")
        wait = self.backoff["subscribe"].next()
        return [Emit(Ev.DISCONNECTED, (("reason", e.code), ("retry_seconds", round(wait, 2)))),
                Wait(wait, e.code, wakeable=True)]
