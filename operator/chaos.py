"""Chaos injection: delete learner pods at a seeded random rate so self-healing gets exercised.

The schedule is a pure function of (seed, mean): kill k happens at the k-th arrival of a
Poisson process, and its victim is a seeded pick among the pods that are ready then. The
schedule's origin and the kills done so far live in `status.chaos`, so an operator restart
neither repeats nor skips kills. Kills beyond `maxConcurrent` learners down wait their turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from diloco.operator import naming as n
from diloco.operator import pods as p
from diloco.spec import Chaos


def arrivals(seed: int, mean: float, until: float) -> int:
    """How many kills the schedule places in the first `until` seconds (Poisson, rate 1/mean)."""
    rng = random.Random(f"diloco-chaos/{seed}")
    t, k = rng.expovariate(1.0 / mean), 0
    while t <= until:
        t, k = t + rng.expovariate(1.0 / mean), k + 1
    return k


def due(seed: int, mean: float, elapsed: float, done: int) -> int:
    """How many kills are due by `elapsed` seconds beyond the `done` already made."""
    return max(0, arrivals(seed, mean, elapsed) - done)


def victim(seed: int, k: int, candidates: list[str]) -> str:
    """The pod that kill k takes: a seeded pick, independent of listing order."""
    return random.Random(f"diloco-chaos/{seed}/{k}").choice(sorted(candidates))


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


def plan(chaos: Chaos, chaos_state: dict[str, Any], pods: list[dict[str, Any]], desired_learners: int,
         now: float) -> list[Kill]:
    """The kills to make now: due by the schedule, within maxConcurrent learners down."""
    learners = [x for x in pods if (x["metadata"].get("labels") or {}).get(n.COMPONENT) == n.LEARNER]
    ready_learners = [x for x in learners if p.ready(x)]
    down = max(0, desired_learners - len(ready_learners))
    budget = max(0, chaos.max_concurrent - down)
    count = min(due(chaos.seed, chaos.mean_seconds_between_kills, now - chaos_state["since"], chaos_state["kills"]),
                budget)
    candidates = {x["metadata"]["name"]: x for x in ready_learners} if "learners" in chaos.targets else {}
    if "syncer" in chaos.targets:
        candidates.update({x["metadata"]["name"]: x for x in pods if p.ready(x) and
                           (x["metadata"].get("labels") or {}).get(n.COMPONENT) == n.SYNCER})
    kills = []
    for i in range(count):
        if not candidates:
            break
        number = chaos_state["kills"] + i
        kills.append(Kill(candidates.pop(victim(chaos.seed, number, list(candidates))), number))
    return kills
