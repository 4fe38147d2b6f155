"""syncer/joins/pacing.py: re-admission streams share one send budget, on a scripted clock."""

from __future__ import annotations

import threading

import pytest

from diloco.syncer.joins.pacing import Pacer

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_burst_goes_at_once_then_the_rate_holds() -> None:
    clock = Clock()
    pacer = Pacer(100 * MB, burst=8 * MB, clock=clock, sleep=clock.sleep)
    assert sum(pacer.take(MB) for _ in range(8)) == 0.0  # a small model's whole Join never waits
    waited = sum(pacer.take(MB) for _ in range(100))  # 100 MB more at 100 MB/s
    assert waited == pytest.approx(1.0) and clock.now == pytest.approx(101.0)


def test_idle_time_refills_the_burst_and_no_more() -> None:
    clock = Clock()
    pacer = Pacer(100 * MB, burst=8 * MB, clock=clock, sleep=clock.sleep)
    for _ in range(50):
        pacer.take(MB)
    clock.now += 60.0  # a minute without Joins
    assert sum(pacer.take(MB) for _ in range(8)) == 0.0
    assert pacer.take(MB) == pytest.approx(0.01)


def test_concurrent_streams_share_the_rate() -> None:
    """Two Joins at once: together they send at the rate, not each at it (real clock, 0.3 s)."""
    pacer = Pacer(40 * MB, burst=0)
    done: list[float] = []

    def stream() -> None:
        done.append(sum(pacer.take(MB) for _ in range(6)))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(done) > 0.35  # 12 MB at 40 MB/s is 0.3 s of sending; each stream waited for its share


def test_unpaced_never_waits_and_a_bad_rate_is_refused() -> None:
    assert Pacer(None).take(1 << 40) == 0.0
    with pytest.raises(ValueError, match="positive"):
        Pacer(0)
