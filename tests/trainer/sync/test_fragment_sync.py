"""The learner loop's fragments (trainer/sync/fragment_sync.py) on the host, without a syncer or JAX.

A step boundary's news about a fragment whose push waits for encoding sends that push first
(against the books as they were), the others after the adoption; the end pushes each fragment's
unmerged progress once and reports whether the syncer accepted all of it; a diverged learner
starts over from the anchors. The loop in trainer/learner.py relies on exactly this order.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from diloco.core.ledger import Arrival, Push
from diloco.trainer.hosts import Hosts
from diloco.trainer.sync.fragment_sync import Fragments, Progress
from diloco.trainer.sync.messages import JoinState, Updates

PLAN = (("a",), ("b",))


class HostRecipe:
    """The three of Recipe's operations the fragments use, on host arrays."""

    def place(self, params: dict[str, Any]) -> dict[str, np.ndarray]:
        return {n: np.array(v, np.float32) for n, v in params.items()}

    def shift(self, theta: dict[str, np.ndarray], by: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: theta[n] + by[n] for n in by}

    def init_state(self, params: dict[str, Any]) -> str:
        return "fresh"


class Link:
    """A scripted syncer link: records the pushes, answers with `script`, then nothing."""

    def __init__(self, script: list[Updates], rounds: int = 10) -> None:
        self.stopping, self.resync = threading.Event(), threading.Event()
        self.stop_requested = False
        self.sent: list[Push] = []
        self.script, self.rounds = list(script), rounds
        self.flushed_with: float | None = None

    def submit(self, item: Push) -> None:
        self.sent.append(item)

    def take_updates(self) -> Updates:
        return self.script.pop(0) if self.script else Updates(None, {}, [], [])

    def until(self, deadline: float) -> bool:
        self.rounds -= 1
        return self.rounds >= 0

    def wait_for_news(self, timeout: float) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        self.flushed_with = timeout
        return True

    def clear_resync(self) -> None:
        self.resync.clear()


def fragments(link: Link, shards: int = 2) -> Fragments:
    joined = JoinState("inc", [0, 0], [list(f) for f in PLAN], {"a": np.zeros(2, np.float32),
                       "b": np.zeros(2, np.float32)}, "fp32", 64, 0, [0, 1], job_tokens=0)
    return Fragments(joined=joined, plan=PLAN, recipe=HostRecipe(), hosts=Hosts(), link=link,
                     adoption="rebase", shards=shards, learners=1, tokens_per_step=8, emit=lambda *a, **k: None)


def trained(f: Fragments, by: float) -> None:
    """One inner step: θ moves by `by` everywhere."""
    f.theta = {n: v + by for n, v in f.theta.items()}
    f.stepped(0.0, 8)


def test_news_of_a_waiting_fragment_sends_its_push_first_and_the_rest_after_the_adoption() -> None:
    link = Link([])
    f = fragments(link)
    trained(f, -1.0)
    assert f.take_due(poison=False) == 0 and [w[0] for w in f.pending] == [0, 1]  # both shards' fragments due
    news = Updates(None, {0: Arrival(1, {"a": np.full(2, 5.0, np.float32)}, 1)}, [], [])
    kept = f.at_boundary(news)
    assert [(o.fragment, o.base_version) for o in link.sent] == [(0, 0)]  # sent against the books before the news
    assert [w[0] for w in kept] == [1] and f.pending == []
    assert f.ledger.versions == [1, 0]
    f.send(kept)
    assert [(o.fragment, o.base_version, o.push_id) for o in link.sent] == [(0, 0, 1), (1, 0, 2)]
    assert all(o.incarnation == "inc" and o.slot == 0 and o.session_tokens == 8 for o in link.sent)
    # The link got the ledger's own records: no second shape of a push on the learner's side.
    assert all(b.in_flight[0] is o for b, o in zip(f.ledger.books, link.sent, strict=True))


def test_a_syncer_restart_drops_the_waiting_pushes() -> None:
    link = Link([])
    f = fragments(link)
    trained(f, -1.0)
    f.take_due(poison=False)
    rejoined = JoinState("inc2", [3, 4], [list(p) for p in PLAN], {"a": np.ones(2, np.float32),
                         "b": np.ones(2, np.float32)}, "fp32", 64, 7, [0, 1])
    assert f.at_boundary(Updates(rejoined, {}, [], [])) == [] and link.sent == []
    assert f.incarnation == "inc2" and f.ledger.versions == [3, 4] and f.schedule.slot == 7
    np.testing.assert_array_equal(f.theta["a"], np.zeros(2))  # rebased: the progress (−1) kept on the new anchors


def test_the_end_pushes_each_fragments_progress_once_and_waits_for_the_answers() -> None:
    link = Link([Updates(None, {}, [], []), Updates(None, {}, [(0, 1, 1, False), (1, 2, 1, False)], [])])
    f = fragments(link)
    trained(f, -1.0)
    assert f.flush(10.0) is True
    assert sorted(o.fragment for o in link.sent) == [0, 1] and link.flushed_with is not None


def test_the_end_gives_up_at_the_deadline_but_sends_the_waiting_pushes() -> None:
    link = Link([], rounds=0)
    f = fragments(link)
    trained(f, -1.0)
    f.take_due(poison=False)
    assert f.flush(10.0) is False
    assert [o.fragment for o in link.sent] == [0, 1] and link.flushed_with is None


def test_a_diverged_learner_starts_over_from_the_anchors_and_skips_a_slot() -> None:
    link = Link([])
    f = fragments(link, shards=1)
    trained(f, float("nan"))
    f.progress.loss = float("nan")
    link.resync.set()
    assert f.start_over() == "fresh"
    np.testing.assert_array_equal(f.theta["a"], np.zeros(2))
    assert not link.resync.is_set() and f.progress.step == 1 and f.schedule.slot == 1
    assert not any(f.ledger.unpushed(p) for p in range(2))


def test_progress_counts_the_devices_wait_between_steps_and_smooths_step_time() -> None:
    pr = Progress()
    pr.dispatched(1.0)  # the first step: nothing to wait for
    assert pr.host_wait == 0.0
    dt = pr.read(0.0, 8)
    assert pr.step_ema == dt and pr.session_tokens == 8 and pr.step_done is not None
    pr.dispatched(pr.step_done + 0.5)
    assert abs(pr.host_wait - 0.5) < 1e-9
