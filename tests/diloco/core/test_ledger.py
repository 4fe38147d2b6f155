"""The learner's books: exact rebase whatever order the syncer's answers arrive in."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diloco.core.codecs import Codec
from diloco.core.fragments import owner
from diloco.core.ledger import Arrival, Ledger, Push, absorb, prepare_push
from diloco.core.rounds import Contribution, RoundBook
from diloco.core.schedule import JobProgress, Schedule, due_fragments, slot_of
from tests.helpers import policy

FRAGMENTS = [["a"], ["b"]]


def books(adoption: str = "rebase") -> tuple[Ledger, dict[str, np.ndarray]]:
    zero = {"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)}
    return Ledger(FRAGMENTS, zero, [0, 0], adoption), {n: v.copy() for n, v in zero.items()}  # type: ignore[arg-type]


def train(theta: dict[str, np.ndarray], ledger: Ledger, by: float) -> None:
    for n in theta:
        theta[n] = theta[n] + by
    ledger.stepped(10)


def push(ledger: Ledger, p: int, local: dict[str, np.ndarray], push_id: int, codec: Codec = "fp32") -> Push:
    """`prepare_push` with what the books do not read set to plain values."""
    return prepare_push(ledger, p, local, codec=codec, block_size=64, push_id=push_id, slot=0, session_tokens=0,
                        incarnation="", step_seconds=0.0, loss=0.0, train_seconds=0.0)


def adopt(ledger: Ledger, theta: dict[str, np.ndarray], version: int, value: float) -> None:
    """Fragment 0 ("a") adopts Θ_a = `value` at `version`: θ_a plus the shift the books return."""
    shift = ledger.adopt(0, version, {"a": np.full(3, value, np.float32)}, lambda: {"a": theta["a"]})
    theta["a"] = theta["a"] + shift["a"]


def test_push_carries_unpushed_progress_and_a_second_push_only_what_is_new() -> None:
    ledger, theta = books()
    train(theta, ledger, 1.0)
    first = push(ledger, 0, {"a": theta["a"]}, push_id=1)
    assert np.allclose(first.delta["a"], -1.0) and (first.steps, first.tokens) == (1, 10)
    train(theta, ledger, 2.0)
    assert np.allclose(ledger.outer_gradient(0, theta)["a"], -2.0)  # the first push's progress is in flight


def test_one_push_record_from_the_books_to_the_wire_built_by_keyword_only() -> None:
    """`prepare_push` makes the learner's one record of a push: the books' version and counts,
    what the loop reports, the bytes. Positional construction is refused (kw_only), so no caller
    can swap two of its counts; once the syncer accepted it the books let go of its bytes."""
    ledger, theta = books()
    train(theta, ledger, 1.0)
    train(theta, ledger, 1.0)
    sent = prepare_push(ledger, 0, {"a": theta["a"]}, codec="fp32", block_size=64, push_id=3, slot=5,
                        session_tokens=900, incarnation="inc", step_seconds=0.25, loss=2.5, train_seconds=7.0)
    assert (sent.fragment, sent.base_version, sent.push_id, sent.slot, sent.steps, sent.tokens, sent.session_tokens,
            sent.incarnation, sent.step_seconds, sent.loss, sent.train_seconds, sent.merged_into) == \
        (0, 0, 3, 5, 2, 20, 900, "inc", 0.25, 2.5, 7.0, None)
    assert len(sent.blob) > 0 and ledger.books[0].in_flight == [sent] and ledger.books[0].steps == 0
    with pytest.raises(TypeError):
        Push(*(getattr(sent, f.name) for f in dataclasses.fields(Push)))  # type: ignore[misc]
    with pytest.raises(ValueError, match="does not carry its book's"):
        ledger.pushed(dataclasses.replace(sent, fragment=1, steps=3))
    ledger.accepted(0, 3, merged_into=1)
    assert sent.merged_into == 1 and len(sent.blob) == 0 and np.allclose(sent.delta["a"], -2.0)


def test_merged_push_is_subtracted_once_whether_reply_or_publish_comes_first() -> None:
    for reply_first in (True, False):
        ledger, theta = books()
        schedule = Schedule(2)
        train(theta, ledger, 1.0)
        push(ledger, 0, {"a": theta["a"]}, push_id=7)
        train(theta, ledger, 0.5)  # progress made while the push is in flight

        def shift(v: dict[str, np.ndarray], theta: dict[str, np.ndarray] = theta) -> None:
            theta.update({n: theta[n] + x for n, x in v.items()})

        # The syncer merged our push (and others'): Θ_a moved to 0.8.
        publish = {0: Arrival(1, {"a": np.full(3, 0.8, np.float32)}, 1)}
        reply = [(0, 7, 1, False)]
        steps = [(reply, {}), ([], publish)] if reply_first else [([], publish), (reply, {})]
        for accepted, published in steps:
            absorb(ledger, schedule, lambda p: {n: theta[n] for n in FRAGMENTS[p]}, shift,
                   accepted=accepted, published=published)
        # θ_a = Θ_a + the 0.5 made after the push; the pushed 1.0 is Θ's business now.
        assert np.allclose(theta["a"], 1.3), reply_first
        assert not ledger.busy(0) and np.allclose(ledger.outer_gradient(0, theta)["a"], -0.5)


def test_a_publish_without_our_push_keeps_all_our_progress() -> None:
    ledger, theta = books()
    train(theta, ledger, 1.0)
    push(ledger, 0, {"a": theta["a"]}, push_id=1)
    ledger.accepted(0, 1, merged_into=2)  # it will be merged into version 2, not 1
    adopt(ledger, theta, 1, 0.3)
    assert np.allclose(theta["a"], 1.3) and ledger.busy(0)
    adopt(ledger, theta, 2, 0.9)
    assert np.allclose(theta["a"], 0.9) and not ledger.busy(0)


def test_a_refused_push_goes_out_again_with_the_next_one() -> None:
    ledger, theta = books()
    train(theta, ledger, 1.0)
    push(ledger, 0, {"a": theta["a"]}, push_id=1)
    train(theta, ledger, 1.0)
    ledger.refused(0, 1)
    again = push(ledger, 0, {"a": theta["a"]}, push_id=2)
    assert np.allclose(again.delta["a"], -2.0) and (again.steps, again.tokens) == (2, 20)


def test_int4_push_error_stays_local_and_leaves_with_the_next_push() -> None:
    zero = {"a": np.zeros(256, np.float32), "b": np.zeros(3, np.float32)}
    ledger = Ledger(FRAGMENTS, zero, [0, 0])
    theta = {"a": np.random.default_rng(0).standard_normal(256).astype(np.float32)}
    ledger.stepped(1)
    sent = push(ledger, 0, theta, push_id=1, codec="int4")
    residual = ledger.outer_gradient(0, theta)["a"]  # what the next push of fragment 0 carries
    assert np.allclose(residual, -theta["a"] - sent.delta["a"], atol=1e-6)
    assert 0 < np.linalg.norm(residual) < 0.2 * np.linalg.norm(theta["a"])  # int4's error, nothing more


def test_overwrite_ablation_drops_unmerged_progress() -> None:
    ledger, theta = books("overwrite")
    train(theta, ledger, 1.0)
    adopt(ledger, theta, 1, 0.3)
    assert np.allclose(theta["a"], 0.3) and not ledger.unpushed(0)


def test_schedule_jumps_forward_never_back() -> None:
    s = Schedule(4, slot=10)
    assert s.take() == (10, range(2, 3))
    assert s.observe(5) == 0 and s.slot == 11
    assert s.observe(14) == 3 and s.take() == (14, range(2, 3)) and s.skipped == 3
    s.skip()
    assert s.take() == (16, range(0, 1)) and s.skipped == 4 and s.next_slot_of(3) == 19


def test_a_sharded_schedule_cuts_each_slot_in_one_fragment_per_shard() -> None:
    """With N shards the plan holds P x N fragments and slot s is due for the N of them that
    make its 1/P of the model, fragment q going to shard q mod N: each shard has one every slot."""
    s = Schedule(12, slot=7, per_slot=3)  # P = 4 slots a cycle
    assert s.cycle == 4 and s.take() == (7, range(9, 12))
    assert [list(due_fragments(slot, 12, 3)) for slot in range(5)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11],
                                                                      [0, 1, 2]]
    assert all(sorted(owner(q, 3) for q in due_fragments(slot, 12, 3)) == [0, 1, 2] for slot in range(8))
    assert [slot_of(q, 12, 3) for q in range(12)] == [q // 3 for q in range(12)]
    assert [s.next_slot_of(q) for q in (0, 3, 6, 9)] == [8, 9, 10, 11]  # the slot taken next is 8
    assert due_fragments(5, 4) == range(1, 2)  # one shard: the plain round robin


def test_the_learning_rate_follows_the_jobs_tokens_not_our_slots() -> None:
    job = JobProgress(learners=4, tokens_per_step=10)
    for _ in range(8):
        job.stepped()
    assert job.position() == 2  # alone so far: our 8 steps are 2 steps of a 4-learner job
    job.observe(4 * 10 * 20)  # the syncer: every learner's 20 steps merged
    assert job.position() == 20
    for _ in range(4):
        job.stepped()
    assert job.position() == 21
    job.observe(4 * 10 * 20 + 10)  # news holding fewer of our steps than we counted: never back
    assert job.position() == 21
    job.observe(0)  # older news changes nothing
    assert job.position() == 21 and job.job_tokens == 4 * 10 * 20 + 10


def c(learner: str, slot: int, fragment: int = 0, session: int = 1, steps: int = 4) -> Contribution[int]:
    return Contribution(learner=learner, fragment=fragment, base_version=0, steps=steps, tokens=steps, payload=steps,
                        session=session, push_id=slot + 1, slot=slot)


def test_a_late_push_rides_along_with_the_next_round_of_its_fragment() -> None:
    book: RoundBook[int] = RoundBook(2, policy(2, quorum=1, cap_seconds=1.0),
                                     combine=lambda a, b: Contribution(
                                         learner=a.learner, fragment=a.fragment, base_version=0, steps=a.steps + b.steps,
                                         tokens=a.tokens + b.tokens, payload=a.payload + b.payload, session=a.session,
                                         push_id=b.push_id, slot=b.slot))
    book.observe_step_time(1.0)
    book.offer(c("a", 0), 0.0, 0)
    assert book.ready(1.0, {"a", "b"}) == [0]
    assert book.close(0, 0).slot == 0 and book.next_slot == 1
    late = book.offer(c("b", 0), 1.2, 1)
    assert late.late and book.ready(2.0, {"a", "b"}) == []  # it opens no lone round
    book.offer(c("a", 2), 2.1, 1)  # the next slot of fragment 0: b's late push joins it
    assert book.ready(2.1, {"a", "b"}) == [0]
    closed = book.close(0, 1)
    assert sorted(x.learner for x in closed.contributions) == ["a", "b"] and closed.slot == 2
    # Only late pushes, and nobody else comes: they close by themselves about a period later.
    book.offer(c("b", 1), 3.0, 1)
    assert book.ready(3.0 + 2 * 1.0 + 0.5, {"a", "b"}) == []
    assert book.ready(3.0 + 2 * 1.0 + 1.0, {"a", "b"}) == [0]
    # Two disjoint pushes of one process in one round are added, not replaced.
    book.offer(c("a", 5, fragment=1), 9.0, 0)
    book.offer(c("a", 7, fragment=1, steps=2), 9.0, 0)
    (only,) = book.close(1, 0).contributions
    assert (only.steps, only.payload) == (6, 6)


def test_a_push_waiting_to_be_encoded_goes_out_before_news_of_its_fragment_or_not_at_all() -> None:
    """The learner encodes a due push after the next step is dispatched; news of that fragment
    in between must find the push on the books, and a restarted syncer must never receive it."""
    from diloco.trainer.sync.messages import Updates

    news = Updates(None, {1: Arrival(3, {"b": np.zeros(3, np.float32)}, 4)}, [(0, 7, 2, False)], [(2, 8)])
    assert [news.before(p) for p in range(4)] == ["send", "send", "send", "keep"]
    assert Updates(None, {}, [], [], share_state=True).before(0) == "keep"
    assert Updates(object(), {1: news.published[1]}, [], []).before(1) == "drop"  # type: ignore[arg-type]


def test_a_slot_late_at_every_shard_skips_one_slot_not_one_per_shard() -> None:
    """Both of a slot's fragments (two shards) come back late: the learner is one slot behind."""
    ledger, theta = books()
    schedule = Schedule(2, slot=4, per_slot=2)
    train(theta, ledger, 1.0)
    for p, push_id in ((0, 1), (1, 2)):
        push(ledger, p, {n: theta[n] for n in FRAGMENTS[p]}, push_id=push_id)
    absorb(ledger, schedule, lambda p: {n: theta[n] for n in FRAGMENTS[p]}, lambda v: None,
           accepted=[(0, 1, 1, True), (1, 2, 1, True)])
    assert (schedule.slot, schedule.skipped) == (5, 1)
