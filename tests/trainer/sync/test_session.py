"""The learner's session with its syncer (trainer/sync/session.py) as a table: events in, actions out.

No gRPC, no threads, no clock: each row feeds a session a list of events and checks the actions
of the last one and the phase it leaves. The jitter's randomness is a fixed draw, so every
backoff is exact: the base (0.2 s) doubling per attempt, capped at 5 s, times 0.5.
"""

from __future__ import annotations

import random

import pytest

from diloco.contract import Event
from diloco.trainer.sync import session as s
from diloco.trainer.sync.session import Phase


class Fixed(random.Random):
    """Every draw 0: a backoff's jitter factor is 0.5."""

    def random(self) -> float:
        return 0.0


def session(*events: s.Event) -> s.Session:
    got = s.Session(Fixed())
    for e in events:
        got.on(e)
    return got


LIVE = (s.Joined("inc-1"),)
ROWS: list[tuple[str, tuple[s.Event, ...], s.Event, list[s.Action], Phase]] = [
    # -- joining
    ("a join admits us", (), s.Joined("inc-1"), [], Phase.LIVE),
    ("a bad token is refused at once", (), s.JoinFailed("UNAUTHENTICATED", "bad token"),
     [s.Refuse("token", "bad token")], Phase.JOINING),
    ("a revoked id is refused at once", (), s.JoinFailed("PERMISSION_DENIED", "no"), [s.Refuse("token", "no")],
     Phase.JOINING),
    ("another model is not admitted", (), s.JoinFailed("INVALID_ARGUMENT", "shapes differ"),
     [s.Refuse("admission", "syncer refused to admit this learner: shapes differ")], Phase.JOINING),
    ("another Θ₀ is not admitted", (), s.JoinFailed("FAILED_PRECONDITION", "init hash"),
     [s.Refuse("admission", "syncer refused to admit this learner: init hash")], Phase.JOINING),
    ("an unreachable syncer is retried", (), s.JoinFailed("UNAVAILABLE", ""), [s.Wait(0.1, "UNAVAILABLE")],
     Phase.JOINING),
    ("a live holder of our id is waited out", (s.JoinFailed("ALREADY_EXISTS", ""),), s.JoinFailed("ALREADY_EXISTS", ""),
     [s.Wait(0.2, "ALREADY_EXISTS")], Phase.JOINING),
    ("a cut join stream is retried, its reason logged", (), s.JoinFailed("CONNECTION", "join stream ended early"),
     [s.Wait(0.1, "join stream ended early")], Phase.JOINING),
    ("the join backoff is capped", tuple(s.JoinFailed("UNAVAILABLE", "") for _ in range(9)),
     s.JoinFailed("UNAVAILABLE", ""), [s.Wait(2.5, "UNAVAILABLE")], Phase.JOINING),
    ("join_with_retry starts its backoff over", (s.JoinFailed("UNAVAILABLE", ""), s.JoinStarted()),
     s.JoinFailed("UNAVAILABLE", ""), [s.Wait(0.1, "UNAVAILABLE")], Phase.JOINING),
    ("an unseeded syncer is seeded, then joined", (), s.Unseeded(1, 2, can_seed=True, holds_view=False),
     [s.Seed(1, 2), s.Retry()], Phase.JOINING),
    ("a syncer that lost its state is seeded and offered our copy", LIVE, s.Unseeded(0, 1, True, True),
     [s.Seed(0, 1), s.RecoverState(), s.Retry()], Phase.LIVE),
    ("without Θ₀ an unseeded syncer's refusal stands", (), s.Unseeded(0, 1, False, False), [s.Reraise()],
     Phase.JOINING),
    # -- the sender
    ("an accepted push", LIVE, s.PushAccepted(), [], Phase.LIVE),
    ("a refused push is told", LIVE, s.PushRefused(3, "stale"),
     [s.Emit(Event.PUSH_REFUSED, (("fragment", 3), ("reason", "stale")))], Phase.LIVE),
    ("an unreachable syncer gets the push again later", LIVE, s.PushFailed("UNAVAILABLE", "", 0, "inc-1"),
     [s.Requeue(), s.Wait(0.1, "UNAVAILABLE")], Phase.LIVE),
    ("a push that timed out is sent again, backing off further", LIVE + (s.PushFailed("DEADLINE_EXCEEDED", "", 0, "inc-1"),),
     s.PushFailed("DEADLINE_EXCEEDED", "", 0, "inc-1"), [s.Requeue(), s.Wait(0.2, "DEADLINE_EXCEEDED")], Phase.LIVE),
    ("an answer resets the send backoff", LIVE + (s.PushFailed("UNAVAILABLE", "", 0, "inc-1"), s.PushAccepted()),
     s.PushFailed("UNAVAILABLE", "", 0, "inc-1"), [s.Requeue(), s.Wait(0.1, "UNAVAILABLE")], Phase.LIVE),
    ("a malformed push: refused, and the loop starts over", LIVE, s.PushFailed("INVALID_ARGUMENT", "nan", 2, "inc-1"),
     [s.Emit(Event.PUSH_REFUSED, (("fragment", 2), ("reason", "nan"))), s.RecordRefused(), s.Resync()], Phase.LIVE),
    ("a fatal answer to a push stops us", LIVE, s.PushFailed("UNAUTHENTICATED", "token", 0, "inc-1"),
     [s.Fatal("syncer refused this learner: token")], Phase.STOPPED),
    ("a restarted syncer is re-joined", LIVE, s.PushFailed("FAILED_PRECONDITION", "", 0, "inc-1"), [s.Rejoin()],
     Phase.REJOINING),
    # -- the subscriber
    ("a broken stream is resubscribed after a backoff", LIVE, s.StreamBroken("UNAVAILABLE", "", "inc-1"),
     [s.Emit(Event.DISCONNECTED, (("reason", "UNAVAILABLE"), ("retry_seconds", 0.1))),
      s.Wait(0.1, "UNAVAILABLE", wakeable=True)], Phase.LIVE),
    ("data resets the subscribe backoff", LIVE + (s.StreamBroken("UNAVAILABLE", "", "inc-1"), s.StreamData()),
     s.StreamBroken("UNAVAILABLE", "", "inc-1"),
     [s.Emit(Event.DISCONNECTED, (("reason", "UNAVAILABLE"), ("retry_seconds", 0.1))),
      s.Wait(0.1, "UNAVAILABLE", wakeable=True)], Phase.LIVE),
    ("a wake resets the subscribe backoff", LIVE + (s.StreamBroken("UNAVAILABLE", "", "inc-1"), s.Woken()),
     s.StreamBroken("UNAVAILABLE", "", "inc-1"),
     [s.Emit(Event.DISCONNECTED, (("reason", "UNAVAILABLE"), ("retry_seconds", 0.1))),
      s.Wait(0.1, "UNAVAILABLE", wakeable=True)], Phase.LIVE),
    ("the subscribe backoff grows", LIVE + (s.StreamBroken("UNAVAILABLE", "", "inc-1"),),
     s.StreamBroken("UNAVAILABLE", "", "inc-1"),
     [s.Emit(Event.DISCONNECTED, (("reason", "UNAVAILABLE"), ("retry_seconds", 0.2))),
      s.Wait(0.2, "UNAVAILABLE", wakeable=True)], Phase.LIVE),
    ("a clean end of the stream: subscribe again at once", LIVE, s.StreamEnded(), [], Phase.LIVE),
    ("a malformed fragment: subscribe again at once for keyframes", LIVE, s.StreamMalformed("bad fragment 1"),
     [s.Emit(Event.DISCONNECTED, (("reason", "bad fragment 1"), ("retry_seconds", 0)))], Phase.LIVE),
    ("a fatal answer to a subscription stops us", LIVE, s.StreamBroken("PERMISSION_DENIED", "gone", "inc-1"),
     [s.Fatal("syncer refused this learner: gone")], Phase.STOPPED),
    # -- a restarted syncer: one re-join, however many threads notice
    ("the subscriber notices a restart first", LIVE, s.StreamBroken("FAILED_PRECONDITION", "", "inc-1"),
     [s.Rejoin()], Phase.REJOINING),
    ("the second to notice waits for the re-join", LIVE + (s.StreamBroken("FAILED_PRECONDITION", "", "inc-1"),),
     s.PushFailed("FAILED_PRECONDITION", "", 0, "inc-1"), [s.AwaitRejoin()], Phase.REJOINING),
    ("a notice about the old syncer after the new join finds the work done",
     LIVE + (s.StreamBroken("FAILED_PRECONDITION", "", "inc-1"), s.Joined("inc-2")),
     s.PushFailed("FAILED_PRECONDITION", "", 0, "inc-1"), [], Phase.REJOINING),
    ("the re-join's state goes to the loop, the subscriber wakes",
     LIVE + (s.StreamBroken("FAILED_PRECONDITION", "", "inc-1"), s.Joined("inc-2")), s.Rejoined("inc-2"),
     [s.HandOver(), s.WakeSubscriber(), s.Emit(Event.REJOINED, (("incarnation", "inc-2"),))], Phase.LIVE),
    ("the new syncer restarting too is re-joined again",
     LIVE + (s.StreamBroken("FAILED_PRECONDITION", "", "inc-1"), s.Joined("inc-2"), s.Rejoined("inc-2")),
     s.StreamBroken("FAILED_PRECONDITION", "", "inc-2"), [s.Rejoin()], Phase.REJOINING),
    ("a refused re-join stops us", LIVE + (s.PushFailed("FAILED_PRECONDITION", "", 0, "inc-1"),),
     s.RejoinFailed("stopped before joining"), [s.Fatal("stopped before joining")], Phase.STOPPED),
    ("a re-join broken off by an error lets the next notice try again",
     LIVE + (s.PushFailed("FAILED_PRECONDITION", "", 0, "inc-1"), s.RejoinAborted()),
     s.StreamBroken("FAILED_PRECONDITION", "", "inc-1"), [s.Rejoin()], Phase.REJOINING),
    ("a stopped session re-joins nothing", LIVE + (s.RejoinFailed("refused"),),
     s.PushFailed("FAILED_PRECONDITION", "", 0, "inc-1"), [], Phase.STOPPED),
]


@pytest.mark.parametrize(("before", "event", "actions", "phase"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_the_session_answers_each_event(before: tuple[s.Event, ...], event: s.Event, actions: list[s.Action],
                                        phase: Phase) -> None:
    got = session(*before)
    assert got.on(event) == actions
    assert got.phase is phase


def test_backoff_is_capped_exponential_with_jitter_from_the_rng_given() -> None:
    b = s.Backoff(rng=random.Random(7))
    waits = [b.next() for _ in range(8)]
    again = s.Backoff(rng=random.Random(7))
    assert waits == [again.next() for _ in range(8)]  # the same draws, the same waits
    for n, w in enumerate(waits):
        ceiling = min(5.0, 0.2 * 2 ** n)
        assert ceiling / 2 <= w <= ceiling
    b.reset()
    assert b.next() <= 0.2


def test_an_event_the_session_does_not_know_is_an_error() -> None:
    with pytest.raises(TypeError):
        s.Session(Fixed()).on(object())  # type: ignore[arg-type]
