"""The run tracker: kills, re-admissions, publish gaps and goodput accounting from events."""

import pytest

from diloco.apps.local.tracker import RunTracker


def ev(t, event, source, **kw):
    return {"t": t, "event": event, "source": source, **kw}


def test_accounting_adds_up_and_counts_lost_work() -> None:
    tr = RunTracker(["a", "b"])
    stream = [
        ev(0, "spawned", "runner", target="a"), ev(0, "spawned", "runner", target="b"),
        ev(5, "joined", "a", restart=0, eval_loss=5.5, pull_seconds=0.5),
        ev(6, "joined", "b", restart=0, eval_loss=5.5, pull_seconds=1.0),
        ev(7, "status", "runner", incarnation="s1", tokens_merged=10, versions=[1, 1], outer_steps=2,
           active_learners=2, seconds_since_publish=0.1),
        ev(10, "progress", "a", train_seconds=4.0, acked_train_seconds=3.5, trained_tokens=400),
        ev(10.5, "kill", "runner", target="a"),
        ev(12, "spawned", "runner", target="a"), ev(12, "restart", "runner", target="a"),
        ev(13, "kill", "runner", target="a"),  # killed again before it joined
        ev(14, "spawned", "runner", target="a"),
        ev(16, "joined", "a", restart=2, eval_loss=3.0, pull_seconds=0.5),
        ev(20, "exit", "a", train_seconds=3.0, acked_train_seconds=3.0, trained_tokens=300),
        ev(20, "exit", "b", train_seconds=12.0, acked_train_seconds=11.0, trained_tokens=1200),
        ev(20, "status", "runner", incarnation="s1", tokens_merged=1750, versions=[9, 9], outer_steps=18,
           active_learners=2, seconds_since_publish=0.1, refused_by={"stale": 30, "impostor": 4}),
    ]
    for e in stream:
        tr.observe(e)
    acc = tr.accounting(wall=20.0)
    assert sum(acc.values()) == pytest.approx(40.0)
    assert acc["productive"] == pytest.approx(3.5 + 3.0 + 11.0)
    assert acc["lost"] == pytest.approx(0.5)  # a's unacknowledged training at the kill; b exited cleanly
    assert acc["state_pull"] == pytest.approx(2.0)
    assert acc["startup"] == pytest.approx(4.5 + 1.0 + 1.5 + 5.0)  # a, a-unjoined, a again, b
    assert tr.readmissions() == 1 and len(tr.kills) == 2
    # Both learners train 100 tokens a second: a capacity of 4,000 tokens in 20 s, 1,750 merged.
    assert tr.capacity_tokens(20.0) == pytest.approx(4000.0)
    assert tr.goodput(20.0) == pytest.approx(1750 / 4000)
    assert tr.availability(20.0) == pytest.approx((5.5 + 4.0 + 14.0) / 40)  # joined until killed or done
    badput = tr.badput(20.0, tokens_per_step=10)
    assert badput["joining"] == pytest.approx(14.0 * 100 / 4000) and badput["lost_to_kills"] == pytest.approx(50 / 4000)
    assert badput["refused"] == pytest.approx(30 * 10 / 4000)  # stale pushes; a superseded process's are no work
    assert sum(badput.values()) + tr.goodput(20.0) == pytest.approx(1.0, abs=1e-3)


def test_publish_gap_only_counts_while_someone_is_up() -> None:
    tr = RunTracker(["a"])
    status = dict(incarnation="s1", tokens_merged=0, versions=[0], outer_steps=0, active_learners=0)
    tr.observe(ev(0, "status", "runner", seconds_since_publish=30.0, **status))  # nobody up yet
    tr.observe(ev(1, "joined", "a", restart=0, eval_loss=5.0))
    tr.observe(ev(3, "status", "runner", seconds_since_publish=33.0, **status))
    assert tr.max_publish_gap == pytest.approx(2.0)  # counted from the join, not from the syncer start
    tr.observe(ev(4, "kill", "runner", target="a"))
    tr.observe(ev(40, "status", "runner", seconds_since_publish=70.0, **status))
    assert tr.max_publish_gap == pytest.approx(2.0)


def test_tokens_trained_takes_a_killed_processs_last_pushes_from_the_syncer() -> None:
    """Progress events come once a second: a learner killed between two of them trained steps
    that only its pushes reported. The syncer's per-learner count covers them; a lower one (a
    restarted syncer forgets) never lowers what the events showed."""
    tr = RunTracker(["a", "b"])
    stream = [
        ev(0, "joined", "a", restart=0), ev(0, "joined", "b", restart=0),
        ev(1, "progress", "a", trained_tokens=4096), ev(1, "progress", "b", trained_tokens=4096),
        ev(1.9, "status", "runner", incarnation="s1", tokens_merged=8192, versions=[2], outer_steps=2,
           active_learners=2, seconds_since_publish=0.1, learners_trained={"a": 6144, "b": 4096}),
        ev(2, "kill", "runner", target="a"),  # a trained 2 more steps after its last progress event
        ev(3, "joined", "a", restart=1), ev(4, "exit", "a", trained_tokens=2048),
        ev(4, "exit", "b", trained_tokens=8192),
        ev(5, "status", "runner", incarnation="s2", tokens_merged=8192, versions=[2], outer_steps=2,
           active_learners=0, seconds_since_publish=0.1, learners_trained={"a": 2048, "b": 1024}),
    ]
    for e in stream:
        tr.observe(e)
    assert tr.tokens_trained == max(4096 + 2048, 6144) + 8192
    tr.observe(ev(6, "status", "runner", incarnation="s2", tokens_merged=9000, versions=[2], outer_steps=2,
                  active_learners=0, seconds_since_publish=0.1, learners_trained={"a": 9216}))
    assert tr.tokens_trained == 9216 + 8192
