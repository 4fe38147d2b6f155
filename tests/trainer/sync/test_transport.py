"""The syncer client's threads carrying out the session's decisions (trainer/sync/client.py,
trainer/sync/transport.py), against a scripted stub: no syncer, no network.

tests/trainer/sync/test_session.py tables the decisions; this checks that the client acts on them: a push
that found the syncer unreachable goes again after the backoff, a malformed one is refused to
the loop and resyncs it, a fatal answer stops the learner, and a syncer restart noticed by both
threads is re-joined once, the other thread waiting for it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from diloco.contract import Event
from diloco.trainer.sync.client import JoinState, Push, SyncerClient
from diloco.trainer.sync.session import Joined
from diloco.trainer.sync.transport import send_loop, subscribe_loop
from diloco.wire import pb


class Fixed(random.Random):
    def random(self) -> float:  # every backoff's jitter factor 0.5: the first wait is 0.1 s
        return 0.0


class Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Stub:
    """PushOne answers from `pushes` in order (an exception is raised); Subscribe, per the
    incarnation asked for, raises or holds the stream open until the client stops."""

    def __init__(self, pushes: list[Any], stopping: threading.Event,
                 subscribe: dict[str, grpc.RpcError] | None = None) -> None:
        self.pushes, self.stopping, self.subscribe = list(pushes), stopping, subscribe or {}
        self.calls: list[str] = []

    def PushOne(self, chunk: pb.PushChunk, **_: Any) -> pb.PushReply:
        self.calls.append(f"push {chunk.header.incarnation}")
        got = self.pushes.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    def Subscribe(self, request: pb.SubscribeRequest, **_: Any) -> Iterator[Any]:
        self.calls.append(f"subscribe {request.incarnation}")
        if request.incarnation in self.subscribe:
            raise self.subscribe[request.incarnation]
        self.stopping.wait(10)
        raise Failure(grpc.StatusCode.CANCELLED)


def client(pushes: list[Any], subscribe: dict[str, grpc.RpcError] | None = None) -> tuple[SyncerClient, list[Any]]:
    events: list[Any] = []
    c = SyncerClient("127.0.0.1:9", "token", "a-0", "r", on_event=lambda e, **f: events.append((e, f)), rng=Fixed())
    c.stub = Stub(pushes, c.stopping, subscribe)
    c.incarnation = "inc-1"
    c.machine.on(Joined("inc-1"))
    return c, events


def item(fragment: int = 0, push_id: int = 1) -> Push:
    return Push(fragment=fragment, base_version=0, push_id=push_id, slot=0, steps=4, tokens=2048, session_tokens=0,
                delta={}, blob=b"x" * 16, incarnation="inc-1", step_seconds=0.05, loss=2.0, train_seconds=1.0)


def run(target: Any, c: SyncerClient) -> threading.Thread:
    t = threading.Thread(target=target, args=(c,), daemon=True)
    t.start()
    return t


def test_an_unreachable_syncer_gets_the_push_again_after_the_backoff() -> None:
    c, events = client([Failure(grpc.StatusCode.UNAVAILABLE), pb.PushReply(accepted=True, merged_into=3)])
    c.submit(item())
    t0 = time.monotonic()
    sender = run(send_loop, c)
    assert c.flush(5)
    assert time.monotonic() - t0 >= 0.1  # the first backoff: 0.2 s x 0.5
    assert c.take_updates().accepted == [(0, 1, 3, False)] and c.stub.calls == ["push inc-1"] * 2
    assert events == []
    c.close()
    sender.join(5)


def test_a_malformed_push_is_refused_to_the_loop_and_resyncs_it() -> None:
    c, events = client([Failure(grpc.StatusCode.INVALID_ARGUMENT, "not finite")])
    c.submit(item(fragment=2, push_id=7))
    sender = run(send_loop, c)
    assert c.flush(5)
    assert c.take_updates().refused == [(2, 7)] and c.resync.is_set()
    assert events == [(Event.PUSH_REFUSED, {"fragment": 2, "reason": "not finite"})]
    c.close()
    sender.join(5)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED])
def test_a_fatal_answer_stops_the_learner(code: grpc.StatusCode) -> None:
    c, events = client([Failure(code, "revoked")])
    c.submit(item())
    sender = run(send_loop, c)
    sender.join(5)
    assert not sender.is_alive() and c.stopping.is_set()
    assert events == [(Event.FATAL, {"reason": "syncer refused this learner: revoked"})]


def test_a_restart_both_threads_notice_is_rejoined_once() -> None:
    restarted = Failure(grpc.StatusCode.FAILED_PRECONDITION, "another incarnation")
    c, events = client([restarted], subscribe={"inc-1": restarted})
    rejoins: list[float] = []

    def join_with_retry(shapes: dict[str, tuple[int, ...]], initial: Any = None) -> JoinState:
        rejoins.append(time.monotonic())
        time.sleep(0.3)  # long enough for the other thread to notice the same restart
        with c.lock:
            c.incarnation = "inc-2"
            c.feed(Joined("inc-2"))
        return JoinState("inc-2", [5], [["a"]], {}, "fp32", 64, 9, [0])

    c.join_with_retry = join_with_retry  # type: ignore[method-assign]
    c.submit(item())
    sender, subscriber = run(send_loop, c), run(subscribe_loop, c)
    deadline = time.monotonic() + 5
    while "subscribe inc-2" not in c.stub.calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(rejoins) == 1  # one re-join, whichever thread noticed first
    assert c.stub.calls.count("subscribe inc-2") == 1  # the subscriber resubscribed to the new syncer once
    rejoined = c.take_updates().rejoined
    assert rejoined is not None and rejoined.incarnation == "inc-2" and rejoined.slot == 9
    assert events == [(Event.REJOINED, {"incarnation": "inc-2"})]
    assert c.machine.phase.value == "live"
    c.close()
    sender.join(5)
    subscriber.join(5)


@pytest.mark.slow
def test_flush_gives_up_at_the_deadline_on_the_clock_given() -> None:
    ticks = iter([100.0, 104.0, 106.0])  # the deadline is 105: one wait of 1 s, then past it
    c = SyncerClient("127.0.0.1:9", "token", "a-0", "r", clock=lambda: next(ticks))
    c.submit(item())  # no sender runs: the outbox never empties
    t0 = time.monotonic()
    assert not c.flush(5)
    assert 0.9 <= time.monotonic() - t0 < 4  # it waited what the clock said was left, not the 5 s asked
    c.close()
