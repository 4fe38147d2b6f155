"""The leader lease (syncer/durable/leader.py): one holder at a time, a takeover only after the
holder's silence, and a holder that lost it, or whose renewals stalled, publishes nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from diloco.checkpoint import CheckpointStore, FencedOut
from diloco.contract import incarnation_epoch, incarnation_host, leased_incarnation
from diloco.syncer.durable import leader


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_one_holder_renews_and_a_silent_one_is_taken_over(tmp_path: Path) -> None:
    store, clock = CheckpointStore(tmp_path), Clock()
    a = leader.LeaderLease(store, "pod-a/1", 10.0, clock)
    b = leader.LeaderLease(store, "pod-b/2", 10.0, clock)
    assert a.acquire(None, "") and a.epoch == 1 and a.valid()
    seen, token = b.read()
    assert seen == leader.Record(1, "pod-a/1") and not b.acquire(None, "")  # it exists: no second epoch 1
    clock.t += 5
    assert a.renew() and b.read()[1] != token  # every renewal is a new version, even of the same epoch
    clock.t += 7.9
    assert a.valid()  # 7.9 s after its last renewal began: within VALID x 10 s
    clock.t += 0.2
    assert not a.valid()  # stalled renewals: it stops publishing before anyone may take over
    seen, token = b.read()
    assert b.acquire(seen, token) and b.epoch == 2 and b.valid()
    assert not a.renew() and a.lost.is_set() and a.successor == leader.Record(2, "pod-b/2")
    assert not a.valid()


def test_a_race_to_take_over_has_one_winner(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    first = leader.LeaderLease(store, "a/1", 4.0)
    assert first.acquire(None, "")
    seen, token = first.read()
    racers = [leader.LeaderLease(store, f"s{i}/{i}", 4.0) for i in range(2)]
    assert [r.acquire(seen, token) for r in racers] == [True, False]


def test_follow_waits_for_the_lease_period_then_takes_over(tmp_path: Path) -> None:
    store, clock = CheckpointStore(tmp_path), Clock()
    active = leader.LeaderLease(store, "a/1", 4.0, clock)
    assert active.acquire(None, "")
    standby = leader.LeaderLease(store, "b/2", 4.0, clock)
    restored: list[int] = []
    stop = threading.Event()
    polls = {"n": 0}

    def restore() -> str:
        restored.append(polls["n"])
        return "model"

    real_wait = stop.wait

    def tick(seconds: float) -> bool:  # each poll: 1 s passes; the active renews for the first 5
        polls["n"] += 1
        clock.t += 1.0
        if polls["n"] <= 5:
            active.renew()
        return real_wait(0)

    stop.wait = tick  # type: ignore[method-assign]
    assert leader.follow(standby, stop, restore, poll=1.0) == ("model", True)
    assert standby.epoch == 2 and polls["n"] >= 5 + 4  # not before 4 s of silence after the last renewal
    assert restored  # the checkpoint it takes over from was read when it took over
    assert store.read_file("WRITER") == b"b/2"  # and the store fenced for it first


def test_a_takeover_fences_the_old_holders_saves(tmp_path: Path) -> None:
    old = CheckpointStore(tmp_path)
    active = leader.LeaderLease(old, "a/1", 60.0)
    assert active.acquire(None, "")
    old.fence(active.holder)
    old.save({"param/w": np.zeros(4, np.float32)}, {"versions": [1]})
    active.release()
    standby = leader.LeaderLease(CheckpointStore(tmp_path), "b/2", 60.0)
    assert leader.follow(standby, threading.Event(), lambda: None, poll=0.01) == (None, False)
    with pytest.raises(FencedOut, match="b/2"):
        old.save({"param/w": np.ones(4, np.float32)}, {"versions": [2]})


def test_the_epoch_rides_in_the_incarnation() -> None:
    inc = leased_incarnation("job-syncer-7d9-abcde/0123456789ab", 3)
    assert incarnation_epoch(inc) == 3 and incarnation_host(inc) == "job-syncer-7d9-abcde"
    assert incarnation_epoch("0123456789ab") == 0 and incarnation_host("0123456789ab") is None


def test_a_lease_handed_back_is_taken_at_once(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    active = leader.LeaderLease(store, "a/1", 60.0)
    assert active.acquire(None, "")
    active.release()  # a clean stop (SIGTERM), after its final checkpoint
    assert not active.valid()
    standby = leader.LeaderLease(store, "b/2", 60.0)
    assert leader.follow(standby, threading.Event(), lambda: None, poll=0.01) == (None, False)  # planned: no takeover
    assert standby.epoch == 2
