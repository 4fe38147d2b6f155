"""Quorum, grace window and staleness on scripted arrival times (no sleeping)."""

import pytest

from diloco.core.rounds import Contribution, RoundBook, Timings, Verdict
from tests.helpers import policy


def push(book: RoundBook, learner: str, t: float, fragment: int = 0, base: int = 0, steps: int = 4, current: int = 0):
    c = Contribution(learner=learner, fragment=fragment, base_version=base, steps=steps, tokens=steps * 1024,
                     payload=None)
    return book.offer(c, t, current)


def test_grace_formula_and_clamps() -> None:
    t = Timings()
    rules = policy(gamma=0.8, tau=2)
    t.step.update(1.0), t.quorum.update(0.2), t.sync.update(0.1)
    assert t.grace(rules) == pytest.approx(1.36)  # 0.8*(2-0.3); the default cap is τ steps
    assert t.grace(policy(cap_seconds=1.0)) == pytest.approx(1.0)
    t.quorum.value = 3.0
    assert t.grace(rules) == 0.0  # no slack left: close at quorum


def test_k1_closes_after_grace_not_before() -> None:
    book: RoundBook = RoundBook(2, policy(quorum=1, cap_seconds=10.0))
    book.observe_step_time(0.5)  # grace = 0.8 * (2*0.5 - 0 - 0) = 0.8 s
    assert push(book, "a", 100.0).verdict is Verdict.ACCEPTED
    active = {"a", "b", "c"}
    assert book.ready(100.5, active) == []
    push(book, "b", 100.6)
    assert book.ready(100.79, active) == []
    assert book.ready(100.8, active) == [0]
    closed = book.close(0, version=0)
    assert [c.learner for c in closed.contributions] == ["a", "b"]
    book.published(sync_seconds=0.05)
    assert book.timings.sync.get() == 0.05 and book.ready(200.0, active) == []


def test_everyone_in_closes_immediately_and_quorum_k2_waits() -> None:
    book: RoundBook = RoundBook(1, policy(quorum=2))
    book.observe_step_time(10.0)
    push(book, "a", 0.0)
    assert book.ready(1000.0, {"a", "b", "c"}) == []  # K=2 not met, however long we wait
    push(book, "b", 3.0)
    assert book.deadline(0) == pytest.approx(3.0 + 16.0)  # 0.8*(2*10) = 16, under the cap of τ steps
    push(book, "c", 4.0)
    assert book.ready(4.0, {"a", "b", "c"}) == [0]
    closed = book.close(0, version=0)
    assert closed.quorum_seconds == 3.0
    assert book.timings.quorum.get() == 3.0


def test_staleness_policies() -> None:
    book: RoundBook = RoundBook(1, policy(max_staleness=2, stale_policy="downweight"))
    assert push(book, "a", 0, base=5, current=5).verdict is Verdict.ACCEPTED
    assert push(book, "b", 0, base=4, current=5).verdict is Verdict.ACCEPTED
    assert push(book, "c", 0, base=2, current=5).verdict is Verdict.STALE
    assert push(book, "d", 0, base=6, current=5).verdict is Verdict.FUTURE
    assert book.close(0, version=5).scales == [1.0, 0.5]
    drop: RoundBook = RoundBook(1, policy(stale_policy="drop"))
    assert push(drop, "a", 0, base=4, current=5).verdict is Verdict.STALE


def test_newer_push_supersedes_and_rounds_are_per_fragment() -> None:
    book: RoundBook = RoundBook(2, policy(quorum=1))
    push(book, "a", 0.0, fragment=1, steps=4)
    push(book, "a", 1.0, fragment=1, steps=8)
    assert book.ready(1.0, {"x"}) == [1]  # no step time known yet: grace 0, fragment 0 has nothing
    closed = book.close(1, version=0)
    assert len(closed.contributions) == 1 and closed.contributions[0].steps == 8
    with pytest.raises(RuntimeError):
        book.close(0, version=0)
