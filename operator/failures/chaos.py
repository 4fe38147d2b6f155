"""Chaos in a cluster: the core's seeded schedule (diloco/core/chaos.py) applied to pods.

The schedule's origin and the kills made so far live in `status.chaos`, so an operator
restart neither repeats nor skips kills. Targets are named as in a local run (learner ids,
`syncer`), so one manifest kills the same targets in the same order here and in `diloco run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.core.chaos import SYNCER, ChaosSchedule
from diloco.operator.failures import pods as p
from diloco.operator.render import naming as n
from diloco.spec import Chaos, JobSpec


@dataclass(frozen=True)
class Kill:
    pod: dict[str, Any]
    number: int


def state(chaos: Chaos, status: dict[str, Any], now: float) -> dict[str, Any]:
    """`status.chaos`, restarted from now when the chaos settings changed (or were never seen)."""
    current = status.get("chaos") or {}
    if current.get("seed") == chaos.seed and current.get("meanSecondsBetweenKills") == chaos.mean_seconds_between_kills:
        return dict(current)
    return {"seed": chaos.seed, "meanSecondsBetweenKills": chaos.mean_seconds_between_kills,
            "since": round(now, 3), "kills": 0}


def ready_targets(pods: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The job's ready pods by chaos target name: learner id, or `syncer`."""
    out = {}
    for pod in pods:
        if not p.ready(pod):
            continue
        learner = n.learner_of(pod)
        if learner is not None:
            out[str(learner[1])] = pod
        elif (pod["metadata"].get("labels") or {}).get(n.COMPONENT) == n.SYNCER:
            out[SYNCER] = pod
    return out


def plan(spec: JobSpec, chaos_state: dict[str, Any], pods: list[dict[str, Any]], now: float) -> list[Kill]:
    """The kills to make now: due by the schedule, within maxConcurrent targets down."""
    schedule = ChaosSchedule(spec.chaos)
    expected = schedule.targets((str(x) for x in spec.learner_ids()), syncer=spec.syncer.external is None)
    up = ready_targets(pods)
    kills = schedule.plan(now - chaos_state["since"], chaos_state["kills"], expected, up.keys())
    return [Kill(up[k.target], k.number) for k in kills]
