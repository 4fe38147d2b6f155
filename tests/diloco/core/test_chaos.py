"""The chaos schedule (diloco/core/chaos.py) and its two users, the local runner and the operator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.apps.local.runner import LocalRun
from diloco.core.chaos import SYNCER, ChaosSchedule
from diloco.operator.failures import chaos as operator_chaos
from diloco.operator.render import naming as n
from diloco.spec import Chaos, parse_job

ALL = ["a-0", "a-1", "b-0", SYNCER]


def test_seeded_poisson_and_restart_safe() -> None:
    chaos = Chaos(enabled=True, mean_seconds_between_kills=10.0, seed=3)
    s = ChaosSchedule(chaos)
    assert s.due(2000, 0) == ChaosSchedule(chaos).due(2000, 0)
    assert 150 <= s.due(2000, 0) <= 250  # ~200 expected at one kill per 10 s
    assert [s.due_at(k) for k in range(5)] != [ChaosSchedule(Chaos(enabled=True, seed=4)).due_at(k) for k in range(5)]
    assert s.due(2000, 10) == s.due(2000, 0) - 10
    # A supervisor that restarts with (origin, kills made) resumes the same schedule.
    first = s.plan(s.due_at(2), 0, ALL, ALL)
    resumed = ChaosSchedule(chaos).plan(s.due_at(2), 1, ALL, ALL)
    assert first[0].number == 0 and resumed[0].number == 1
    assert s.victim(3, ["b-0", "a-0", SYNCER]) == s.victim(3, [SYNCER, "a-0", "b-0"])  # not listing order


def test_due_kills_wait_within_max_concurrent_and_are_never_skipped() -> None:
    s = ChaosSchedule(Chaos(enabled=True, mean_seconds_between_kills=1.0, max_concurrent=1, targets=["learners"]))
    learners = ["a-0", "a-1"]
    assert s.plan(100, 0, learners, ["a-0"]) == []  # one already down: kills wait
    assert s.plan(100, 0, learners, []) == []
    kills = s.plan(100, 0, learners, learners)
    assert len(kills) == 1 and kills[0].number == 0  # then the oldest due kill goes first
    assert ChaosSchedule(Chaos(enabled=False)).plan(1e6, 0, learners, learners) == []
    assert s.targets(["b-0", "a-0"]) == ["a-0", "b-0"]
    assert ChaosSchedule(Chaos(targets=["learners", "syncer"])).targets(["a-0"], syncer=False) == ["a-0"]


def _learner_pod(job: str, learner: str) -> dict[str, Any]:
    group, index = learner.rsplit("-", 1)
    labels = {**n.labels(job, n.LEARNER, group), n.INDEX: index}
    return _pod(f"{job}-{learner}", labels)


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels, "uid": name},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_local_runner_and_operator_draw_identical_kill_schedules(tmp_path: Path) -> None:
    """One manifest, both supervisors, the same life of every target (a kill takes it down
    for `DOWN` seconds): the same kills, at the same moments, of the same targets."""
    job = parse_job({
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
        "spec": {"learnerGroups": [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}],
                 "chaos": {"enabled": True, "meanSecondsBetweenKills": 4, "seed": 11, "maxConcurrent": 2,
                           "targets": ["learners", "syncer"]}}})
    DOWN, STEP, END = 6.0, 0.5, 120.0

    local = LocalRun(job, tmp_path, None)
    local.tracker.observe({"t": 0.0, "event": "status", "source": "runner", "incarnation": "i0", "versions": [0],
                           "tokens_merged": 0, "outer_steps": 0, "active_learners": 3, "seconds_since_publish": 0})
    for name in local.tracker.slots:
        local.tracker.observe({"t": 0.0, "event": "joined", "source": name})
    pods = {t: _learner_pod("j", t) for t in ALL if t != SYNCER}
    pods[SYNCER] = _pod("j-syncer-7f9c", n.labels("j", n.SYNCER))
    state = {"since": 0.0, "kills": 0}

    local_kills, operator_kills, back = [], [], {"local": {}, "operator": {}}
    t = 0.0
    while t < END:
        for target, at in list(back["local"].items()):  # restarted: a learner joins, a syncer answers
            if t >= at:
                del back["local"][target]
                event = ({"event": "status", "incarnation": f"i{t}", "versions": [0], "tokens_merged": 0,
                          "outer_steps": 0, "active_learners": 3, "seconds_since_publish": 0}
                         if target == SYNCER else {"event": "joined"})
                local.tracker.observe({"t": t, "source": "runner" if target == SYNCER else target, **event})
        for target, at in list(back["operator"].items()):  # the controllers made a ready pod again
            if t >= at:
                del back["operator"][target]
                pods[target] = _learner_pod("j", target) if target != SYNCER else _pod("j-syncer-x", n.labels("j", n.SYNCER))

        for kill in local.chaos_step(t):
            local_kills.append((t, kill.number, kill.target))
            back["local"][kill.target] = t + DOWN
        for kill in operator_chaos.plan(job.spec, state, list(pods.values()), t):
            target = next(k for k, v in pods.items() if v is kill.pod)
            operator_kills.append((t, kill.number, target))
            del pods[target]
            back["operator"][target] = t + DOWN
            state["kills"] += 1
        t += STEP
    local.events.close()
    for channel in local.channels:
        channel.close()

    assert local_kills == operator_kills
    assert len(local_kills) >= 15 and {k[2] for k in local_kills} == set(ALL)
